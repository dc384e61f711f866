"""`erpo-jax analyze` (the paper's appendix D): question NLL against the NLL of the model's own responses.

For a seeded sample of training questions q (dataset order, prompts as training
feeds them) and one model:

    question NLL  s_q = -sum_{t in prompt, t >= 1} log p(x_t | x_<t)   (the positions training scores:
                  every prompt token, or with erpo.query_span=question the question's tokens only)
    response NLL  r_q = mean over G sampled responses of -sum_{t in response} log p(x_t | x_<t)

responses drawn at rollout.temperature, G = rollout.group_size, up to
rollout.max_new_tokens tokens (EOS included), log-probs at temperature 1. Also
the per-token response NLL (each response's NLL over its length, mean over G).
Pearson and Spearman correlations of (s_q, r_q) go to the console, the points
to analyze.json and a scatter plot to analyze.png.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from erpo_jax.algo.kl import scored_mask
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.errors import ConfigError
from erpo_jax.experiment import plots, stats
from erpo_jax.model import logprobs
from erpo_jax.model.io.loading import load_model
from erpo_jax.rollout.sampler import Sampler
from erpo_jax.train.checkpoint_io import find_checkpoint, restore_params

JSON_NAME = "analyze.json"
PNG_NAME = "analyze.png"


def sample_questions(num_questions: int, num: int, seed: int) -> list[int]:
  """`num` distinct dataset indices (all when num >= num_questions), sorted."""
  if num >= num_questions:
    return list(range(num_questions))
  return sorted(int(i) for i in np.random.default_rng(seed).choice(num_questions, num, replace=False))


def nll_points(model, tokenizer, prompts: list[list[int]], *, group_size: int, max_new_tokens: int,
               temperature: float, key, chunk: int, batch_size: int = 8, top_p: float = 1.0, top_k: int = 0,
               min_prompt_bucket: int = 16, question_masks: list[list[bool]] | None = None) -> dict[str, list]:
  """Per prompt: question NLL, mean response NLL (summed and per token), mean response length, responses' ids.

  Batch i of prompts samples with fold_in(key, i). With question_masks (one bool per prompt token) the
  question NLL sums over the masked tokens only (erpo.query_span=question), else over the whole prompt.
  """

  graphdef, state = nnx.split(model)
  sampler = Sampler(graphdef, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    top_k=top_k, min_prompt_bucket=min_prompt_bucket)

  @jax.jit
  def nll_rows(state, tokens_NxS, query_mask_NxS, response_mask_NxS):
    logp_NxS = logprobs.log_probs(nnx.merge(graphdef, state), tokens_NxS, chunk=chunk)
    q_N = -jnp.where(scored_mask(query_mask_NxS), logp_NxS, 0.0).sum(axis=1)
    r_N = -jnp.where(response_mask_NxS, logp_NxS, 0.0).sum(axis=1)
    return q_N, r_N

  G = group_size
  out = {"question_nll": [], "response_nll": [], "response_nll_per_token": [], "response_len": [], "responses": []}
  for i, start in enumerate(range(0, len(prompts), batch_size)):
    batch = prompts[start:start + batch_size]
    b = len(batch)
    padded = batch + [batch[-1]] * (batch_size - b)  # one shape: one compile
    roll = sampler.generate(state, padded, group_size=G, key=jax.random.fold_in(key, i))
    query_mask = roll.prompt_mask
    if question_masks is not None:  # prompts start at column 0 of their rows
      masks = question_masks[start:start + batch_size]
      masks = masks + [masks[-1]] * (batch_size - b)
      query_mask = np.zeros(roll.prompt_mask.shape, bool)
      for n in range(query_mask.shape[0]):
        m = masks[n // G]
        query_mask[n, :len(m)] = m
    q_N, r_N = jax.device_get(nll_rows(state, roll.tokens, query_mask, roll.response_mask))
    tokens = np.asarray(roll.tokens)
    p_len, r_len = np.asarray(roll.prompt_len), np.asarray(roll.response_len)
    for j in range(b):
      rows = range(j * G, (j + 1) * G)
      lens = np.array([max(int(r_len[n]), 1) for n in rows], np.float64)
      out["question_nll"].append(float(q_N[j * G]))
      out["response_nll"].append(float(np.mean([r_N[n] for n in rows])))
      out["response_nll_per_token"].append(float(np.mean([r_N[n] for n in rows] / lens)))
      out["response_len"].append(float(np.mean([r_len[n] for n in rows])))
      out["responses"].append([tokens[n, p_len[n]:p_len[n] + r_len[n]].tolist() for n in rows])
  return out


def correlations(points: dict[str, list]) -> dict[str, float]:
  """Pearson and Spearman of question NLL against response NLL (summed, and per token)."""
  q = points["question_nll"]
  return {"pearson": stats.pearson(q, points["response_nll"]), "spearman": stats.spearman(q, points["response_nll"]),
          "pearson_per_token": stats.pearson(q, points["response_nll_per_token"]),
          "spearman_per_token": stats.spearman(q, points["response_nll_per_token"])}


def analyze_model(cfg, model, tokenizer, *, num: int, seed: int) -> dict:
  """The analysis of one loaded model on `num` training questions -> JSON-ready dict."""

  rows = dataset_prompts(cfg, tokenizer)  # erpo.query_span=question: every question located, or a DataError
  all_prompts = [tokens for tokens, _ in rows]
  index = sample_questions(len(all_prompts), num, seed)
  question_masks = [rows[i][1] for i in index] if cfg.erpo.query_span == "question" else None
  points = nll_points(model, tokenizer, [all_prompts[i] for i in index], group_size=cfg.rollout.group_size,
                      max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                      key=jax.random.key(seed), chunk=cfg.model.logits_chunk, batch_size=cfg.eval.batch_size,
                      top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, min_prompt_bucket=cfg.rollout.min_prompt_bucket,
                      question_masks=question_masks)
  return {"num": len(index), "query_span": cfg.erpo.query_span, "seed": seed, "group_size": cfg.rollout.group_size,
          "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
          **correlations(points), "index": index, **points}


def format_summary(result: dict, label: str = "") -> str:
  who = f"{label}: " if label else ""
  return (f"{who}{result['num']} questions x {result['group_size']} responses: question NLL vs response NLL "
          f"Pearson {result['pearson']:.3f}, Spearman {result['spearman']:.3f} "
          f"(per-token response NLL: Pearson {result['pearson_per_token']:.3f}, "
          f"Spearman {result['spearman_per_token']:.3f})")


def run_analyze(cfg, *, checkpoint: str | None = None, num: int | None = None, seed: int | None = None,
                out: str | None = None, title: str = "") -> dict:
  """`erpo-jax analyze`: loads the model (or a checkpoint of run.dir), writes analyze.json and analyze.png.

  Default folder <run.dir>/analyze/<base|step<k>>; num and seed default to experiment.analyze_num
  and experiment.analyze_seed.
  """

  num = cfg.experiment.analyze_num if num is None else num
  if num < 1:
    raise ConfigError(f"analyze: --num expected an integer >= 1, got {num}")
  model, tokenizer = load_model(cfg.model)
  label = "base"
  if checkpoint is not None:
    step_dir = find_checkpoint(checkpoint, cfg.run.dir)
    model = restore_params(model, str(step_dir), cfg.run.dir)
    label = f"step{step_dir.name}"
  folder = pathlib.Path(out) if out else pathlib.Path(cfg.run.dir) / "analyze" / label
  result = {"model": cfg.model.path, "checkpoint": checkpoint,
            **analyze_model(cfg, model, tokenizer, num=num,
                                  seed=cfg.experiment.analyze_seed if seed is None else seed)}
  folder.mkdir(parents=True, exist_ok=True)
  tmp = folder / (JSON_NAME + ".tmp")
  tmp.write_text(json.dumps(result) + "\n")
  plots.nll_scatter(folder / PNG_NAME, {title or label: result})
  tmp.replace(folder / JSON_NAME)  # last: a folder with analyze.json is complete
  print(format_summary(result, title or label))
  print(f"analysis: {folder / JSON_NAME}, {folder / PNG_NAME}")
  return result

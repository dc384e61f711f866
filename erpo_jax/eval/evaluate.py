"""Evaluation as the paper does it: a temperature sweep reporting Avg@k, Pass@k and Pass@1 per benchmark.

Dimension letters: P problems of a set, B problems per sampler call, G samples
per problem in one call, N = B*G rows, K = eval.k samples per problem.

For every set and temperature each problem gets K samples (B problems per
sampler call, group_size = K) that the Verifier scores; `passk` turns the
correct flags into Avg@K, Pass@K and Pass@1, next to the mean response length
(tokens, EOS included) and the truncation rate (no EOS within max_new_tokens).
Temperature 0 is greedy: the K samples would be identical, so ONE is drawn
and counted K times (Avg@K = Pass@K = Pass@1 = greedy accuracy).

Averages: "mean" over temperatures (per set) and over sets (per temperature,
and both) are unweighted means of the rows, the paper's "Avg." columns.

Determinism: batch i of set s at temperature t samples with
fold_in(fold_in(fold_in(key(seed), crc32(s)), round(1000 t)), i), so a
(set, temperature) cell does not depend on which other cells the sweep holds.
"""

from __future__ import annotations

import dataclasses
import pathlib
import zlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from erpo_jax.config import Config
from erpo_jax.data.check import resolve_extract, resolve_max_prompt_tokens
from erpo_jax.data.prompts import encode_prompt
from erpo_jax.data.sources import make_eval_source
from erpo_jax.errors import ConfigError
from erpo_jax.eval import passk, report
from erpo_jax.eval.passk import MEAN, metric_names, temperature_key
from erpo_jax.model.io.loading import load_model
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import multihost
from erpo_jax.reward.verifier import Verifier
from erpo_jax.rollout.sampler import Sampler, response_texts
from erpo_jax.train.checkpoint_io import find_checkpoint, restore_params


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """The encoded problems of one benchmark."""

  label: str  # short unique name used in keys and TensorBoard tags: file stem, or "arithmetic"
  source: str  # as given in eval.sets
  prompt_tokens: list[list[int]]  # [P] prompt ids, rendered exactly as in training
  answers: list[str]  # [P] ground truth
  skipped_overlong: int  # problems dropped: prompt longer than data.max_prompt_tokens with on_overlong=skip


def set_labels(sources: tuple[str, ...] | list[str]) -> list[str]:
  """'builtin:arithmetic' -> 'arithmetic', a file -> its stem; repeated labels get '_2', '_3', ..."""
  labels: list[str] = []
  for s in sources:
    base = s.split(":", 1)[1] if s.startswith("builtin:") else pathlib.Path(s).name.split(".")[0]
    base = base or "set"
    label, i = base, 2
    while label in labels or label == MEAN:
      label, i = f"{base}_{i}", i + 1
    labels.append(label)
  return labels


def read_eval_records(cfg: Config, sources, max_problems: int = 0) -> list[tuple[str, str, list]]:
  """(label, source, records) of each source: its first max_problems records (0 = all)."""

  if not sources:
    raise ConfigError("eval.sets: expected at least one benchmark (a .jsonl/.parquet file or builtin:arithmetic)")
  out = []
  for label, spec in zip(set_labels(sources), sources):
    records = list(make_eval_source(cfg, spec))
    out.append((label, spec, records[:max_problems] if max_problems else records))
  return out


def load_eval_sets(cfg: Config, tokenizer, sources, max_problems: int = 0, read=None) -> list[EvalSet]:
  """Each source's records (or those of `read`, from read_eval_records) with prompts encoded as training does."""

  out = []
  for label, spec, records in read or read_eval_records(cfg, sources, max_problems):
    prompts, answers, skipped = [], [], 0
    for r in records:
      enc = encode_prompt(r, tokenizer, cfg.data)
      if enc.overlong and cfg.data.on_overlong == "skip":
        skipped += 1
        continue
      prompts.append(enc.tokens)
      answers.append(r.answer)
    if not prompts:
      raise ConfigError(f"eval.sets: '{spec}' has no problem whose prompt fits data.max_prompt_tokens="
                        f"{cfg.data.max_prompt_tokens}")
    out.append(EvalSet(label, spec, prompts, answers, skipped))
  return out


def make_sampler(graphdef_or_model, tokenizer, cfg: Config, mesh=None):
  """The eval sampler: rollout's top_p / top_k and prompt buckets, eval.max_new_tokens (0 = rollout's)."""

  return Sampler(graphdef_or_model, tokenizer, max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                 temperature=1.0, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                 min_prompt_bucket=cfg.rollout.min_prompt_bucket, max_prompt_len=cfg.data.max_prompt_tokens,
                 on_overlong="truncate", mesh=mesh)


def cell_key(seed: int, label: str, temperature: float) -> jax.Array:
  """The key of one (set, temperature) cell; batch i then uses fold_in(cell_key, i)."""
  key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(label.encode()) & 0x7FFFFFFF)
  return jax.random.fold_in(key, int(round(1000 * temperature)))


def _to_numpy(x) -> np.ndarray:
  """The whole array on this host (rows of other processes included)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def evaluate_cell(sampler, state, es: EvalSet, tokenizer, verifier, *, temperature: float, k: int, key,
                  batch_size: int, batch_multiple: int = 1, keep_responses: bool = False) -> dict:
  """Samples and scores one (set, temperature) cell -> row {avg@k, pass@k, pass@1, response_len, truncated,
  samples, example[, responses]}.

  Each sampler call holds B = min(batch_size, P) problems rounded up to batch_multiple
  (the mesh's batch shards); the last batch repeats its last prompt to keep that
  shape, so the sampler compiles once per prompt bucket. Padding rows are dropped.
  """
  greedy = temperature == 0
  G = 1 if greedy else k
  P = len(es.prompt_tokens)
  B = -(-min(batch_size, P) // batch_multiple) * batch_multiple
  correct_PxG = np.zeros((P, G), bool)
  len_sum = trunc_sum = 0
  example, responses = None, []
  for i, start in enumerate(range(0, P, B)):
    prompts = es.prompt_tokens[start:start + B]
    b = len(prompts)
    roll = sampler.generate(state, prompts + [prompts[-1]] * (B - b), group_size=G,
                            key=jax.random.fold_in(key, i), temperature=temperature)
    rows = b * G
    tokens_NxS = _to_numpy(roll.tokens)[:rows]
    prompt_len_N = _to_numpy(roll.prompt_len)[:rows]
    response_len_N = _to_numpy(roll.response_len)[:rows]
    truncated_N = _to_numpy(roll.truncated)[:rows]
    texts = response_texts(tokens_NxS, prompt_len_N, response_len_N, tokenizer)
    answers_N = [a for a in es.answers[start:start + b] for _ in range(G)]
    scored = verifier.score(texts, answers_N)
    correct_PxG[start:start + b] = np.asarray(scored.correct, bool).reshape(b, G)
    responses += [texts[j:j + G] for j in range(0, rows, G)]
    len_sum += int(response_len_N.sum())
    trunc_sum += int(truncated_N.sum())
    if example is None:
      example = {"answer": answers_N[0], "response": texts[0], "extracted": scored.extracted[0],
                 "correct": bool(scored.correct[0])}
  # Greedy: the K samples are the one greedy response, K times.
  correct_PxK = np.repeat(correct_PxG, k, axis=1) if greedy else correct_PxG
  row = passk.set_scores(correct_PxK, k)
  row["response_len"] = len_sum / (P * G)
  row["truncated"] = trunc_sum / (P * G)
  row["samples"] = G
  row["example"] = example
  if keep_responses:
    row["responses"] = responses  # [P][G] texts
  return row


def evaluate(model_or_state, graphdef, tokenizer, cfg: Config, *, sets, temperatures, k: int, seed: int,
             mesh=None, max_problems: int = 0, sampler=None, eval_sets: list[EvalSet] | None = None,
             verifier=None, keep_responses: bool = False) -> dict:
  """The sweep sets x temperatures with k samples per problem; returns a JSON-ready dict.

      {"k", "seed", "temperatures", "max_new_tokens",
       "sets": {label: {"source", "problems", "skipped_overlong",
                        "by_temperature": {"t0.5": row, ...}, "mean": row}},
       "mean": {"by_temperature": {"t0.5": row, ...}, "mean": row}}

  A row holds avg@k, pass@k, pass@1, response_len, truncated; a cell's row also the
  samples drawn per problem, one example and, with keep_responses, every response
  text ([P][samples]). `graphdef` may be None when `model_or_state` is an nnx.Module.
  `sampler`, `eval_sets` and `verifier` may be passed to reuse compiled programs,
  encoded prompts and verifier processes.
  """

  if isinstance(model_or_state, nnx.Module):
    graphdef, state = nnx.split(model_or_state)
  else:
    state = model_or_state
  temperatures = tuple(float(t) for t in temperatures)
  if not temperatures:
    raise ConfigError("eval.temperatures: expected at least one temperature")
  if eval_sets is None:
    eval_sets = load_eval_sets(cfg, tokenizer, tuple(sets), max_problems)
  if sampler is None:
    sampler = make_sampler(graphdef, tokenizer, cfg, mesh)
  multiple = mesh_lib.num_batch_shards(mesh) if mesh is not None else 1
  names = metric_names(k)
  own_verifier = verifier is None
  verifier = Verifier(resolve_extract(cfg).reward) if own_verifier else verifier
  try:
    by_set = {}
    for es in eval_sets:
      cells = {}
      for t in temperatures:
        cells[temperature_key(t)] = evaluate_cell(sampler, state, es, tokenizer, verifier, temperature=t, k=k,
                                                  key=cell_key(seed, es.label, t),
                                                  batch_size=cfg.eval.batch_size, batch_multiple=multiple,
                                                  keep_responses=keep_responses)
      by_set[es.label] = {"source": es.source, "problems": len(es.prompt_tokens),
                          "skipped_overlong": es.skipped_overlong, "by_temperature": cells,
                          MEAN: passk.mean_of(list(cells.values()), names)}
  finally:
    if own_verifier:
      verifier.close()
  per_temp = {tk: passk.mean_of([s["by_temperature"][tk] for s in by_set.values()], names)
              for tk in map(temperature_key, temperatures)}
  return {"k": k, "seed": seed, "temperatures": list(temperatures), "max_new_tokens": sampler.max_new_tokens,
          "sets": by_set, MEAN: {"by_temperature": per_temp, MEAN: passk.mean_of(list(per_temp.values()), names)}}


_TRAINING_EVALUATOR: dict = {}  # one entry: what eval_during_training builds once per run


def eval_during_training(params_state, graphdef, tokenizer, cfg: Config, step: int, mesh) -> dict[str, float]:
  """The in-training eval: eval.sets at ONE temperature, the one of eval.temperatures closest to
  rollout.temperature, with eval.k samples and eval.max_problems problems per set.

  Returns eval/accuracy (Avg@k over the sets, for eval/gap = train accuracy - eval
  accuracy), eval/pass@k, eval/pass@1, eval/response_len, eval/truncated, eval/temperature
  and eval/<set>/<metric>. The sampler and encoded prompts are built on the first call
  and reused, so later calls compile nothing; the seed is eval.seed (the same samples'
  randomness every step, so changes across steps come from the weights).
  """
  del step  # the same key every time: the curve then shows the weights' effect only
  ident = (id(graphdef), id(tokenizer), id(mesh), cfg)
  entry = _TRAINING_EVALUATOR.get("entry")
  if entry is None or entry["ident"] != ident:
    eval_sets = load_eval_sets(cfg, tokenizer, cfg.eval.sets, cfg.eval.max_problems)
    entry = {"ident": ident, "keep": (graphdef, tokenizer, mesh), "eval_sets": eval_sets,
             "sampler": make_sampler(graphdef, tokenizer, cfg, mesh)}
    _TRAINING_EVALUATOR["entry"] = entry
  t = passk.closest_temperature(cfg.eval.temperatures, cfg.rollout.temperature)
  res = evaluate(params_state, graphdef, tokenizer, cfg, sets=cfg.eval.sets, temperatures=(t,), k=cfg.eval.k,
                 seed=cfg.eval.seed, mesh=mesh, sampler=entry["sampler"], eval_sets=entry["eval_sets"])
  k = cfg.eval.k
  overall = res[MEAN][MEAN]
  out = {"eval/accuracy": overall[f"avg@{k}"], "eval/temperature": t}
  out.update({f"eval/{m}": overall[m] for m in metric_names(k)[1:]})
  for label, s in res["sets"].items():
    out.update({f"eval/{label}/{m}": s[MEAN][m] for m in metric_names(k)})
  return {key: float(v) for key, v in out.items()}


def run_eval(cfg: Config, *, checkpoint: str | None = None, out: str | None = None) -> dict:
  """`erpo-jax eval`: the sweep eval.sets x eval.temperatures on the model (or a checkpoint of it).

  Writes the results JSON (default <run.dir>/eval/eval_step<step>.json, eval_base.json
  for the untrained model), TensorBoard scalars under <run.dir>/tb at the checkpoint's
  step (0 for the base model), and prints the table. Returns the results.
  """

  cfg = resolve_max_prompt_tokens(cfg)  # data.max_prompt_tokens = 0 (auto): what the data need
  mesh = mesh_lib.make_mesh(cfg.mesh)
  read = read_eval_records(cfg, cfg.eval.sets, cfg.eval.max_problems)  # data errors before the slow model load
  tensorboard = cfg.log.tensorboard
  if multihost.is_main():  # and a folder the results cannot be written to
    report.check_writable(pathlib.Path(out).parent if out else pathlib.Path(cfg.run.dir) / "eval",
                          "--out" if out else "run.dir")
    if tensorboard and not report.writable(pathlib.Path(cfg.run.dir) / "tb"):
      multihost.warn(f"{pathlib.Path(cfg.run.dir) / 'tb'} is not writable: no TensorBoard scalars for this eval")
      tensorboard = False
  model, tokenizer = load_model(cfg.model)
  step = None
  if checkpoint is not None:
    step_dir = find_checkpoint(checkpoint, cfg.run.dir)
    model = restore_params(model, str(step_dir), cfg.run.dir)
    step = int(step_dir.name) if step_dir.name.isdigit() else None
  mesh_lib.shard_model(model, mesh)
  graphdef, state = nnx.split(model)
  eval_sets = load_eval_sets(cfg, tokenizer, cfg.eval.sets, read=read)
  results = evaluate(state, graphdef, tokenizer, cfg, sets=cfg.eval.sets, temperatures=cfg.eval.temperatures,
                     k=cfg.eval.k, seed=cfg.eval.seed, mesh=mesh, eval_sets=eval_sets)
  results = {"model": cfg.model.path, "checkpoint": checkpoint, "step": step, **results}
  path = pathlib.Path(out) if out else (pathlib.Path(cfg.run.dir) / "eval" /
                                        (f"eval_step{step}.json" if step is not None else "eval_base.json"))
  if multihost.is_main():
    report.write_json(path, results)
    if tensorboard:
      report.write_tensorboard(pathlib.Path(cfg.run.dir) / "tb", passk.scalars(results), step or 0)
  multihost.log(passk.format_table(results))
  multihost.log(f"eval results: {path}")
  return results


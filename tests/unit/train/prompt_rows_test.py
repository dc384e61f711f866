"""Prompt rows: the power-of-two bucket cut to the data set's longest prompt, in the rollout and the update, with
the same update and no extra compile."""

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax import buckets
from erpo_jax.bench import probe as bench_probe
from erpo_jax.bench import step as bench_step
from erpo_jax.config_io import load_config
from erpo_jax.metrics import read_jsonl
from erpo_jax.train import loop
from erpo_jax.train import step as train_step
from erpo_jax.rollout.sampler import Sampler

TEMPLATED = ["data.chat_template=true", "data.max_prompt_tokens=64", "data.levels=[1,2,3]"]


def test_prompt_bucket_is_cut_to_the_fine_bucket_of_the_data_sets_longest_prompt():
  assert buckets.prompt_bucket(43, 16, 43) == 48  # the embedded default's prompts: 36-43 tokens
  assert buckets.prompt_bucket(43, 16) == 64  # the longest unknown (no reference cache): the power of two
  assert buckets.prompt_bucket(12, 16, 43) == 16  # a batch of short prompts keeps its smaller bucket
  assert buckets.prompt_bucket(100, 16, 100) == 112 and buckets.prompt_bucket(128, 16, 128) == 128
  assert buckets.prompt_bucket(50, 16, 43) == 64  # a prompt past the stated longest is never cut
  # No value the powers of two do not already bring: at most one program per plain bucket.
  for longest in (17, 43, 100, 300, 1000):
    plain = {buckets.prompt_bucket(n, 16) for n in range(1, longest + 1)}
    cut = {n: buckets.prompt_bucket(n, 16, longest) for n in range(1, longest + 1)}
    assert len(set(cut.values())) <= len(plain) and all(p >= n for n, p in cut.items())
    assert max(cut.values()) - longest < max(16, longest // 8 + 8)


def test_the_update_on_cut_prompt_rows_equals_the_update_on_the_samplers_rows():
  """One ERPO update (Query-KL on the prompt, cached reference, static weights) of a chat-templated batch on
  prompt rows of 48 and of 64 tokens, responses packed as in the default: the same metrics and the same new
  parameters."""
  cfg = load_config("configs/tiny.yaml", [*TEMPLATED, "erpo.reference=cached", "erpo.weights=static",
                                          "log.policy_kl_every=0"])
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfg)
  assert 32 < max(len(p) for p in prompts) <= 48
  inp = bench_step.prepare_inputs(cfg, model, prompts, vocab=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                                  with_reference=False)
  step_fn = train_step.build_train_step(inp.graphdef, inp.tx, inp.schedule, cfg, mesh=inp.mesh,
                                        param_shardings=inp.param_sh, opt_shardings=inp.opt_sh)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  N, R = inp.shape["N"], cfg.rollout.max_new_tokens
  capacity = buckets.packed_capacity(N * inp.shape["response_len"], N * R, minimum=8)
  out = {P: step_fn(copy(inp.params), copy(inp.opt_state), None, inp.batch, P, capacity) for P in (64, 48)}
  for name in ("loss/total", "loss/pg", "kl/query", "optim/grad_norm", "weight/mean"):
    np.testing.assert_allclose(float(out[48][2][name]), float(out[64][2][name]), rtol=1e-5, atol=1e-7)
  assert float(out[64][2]["kl/query"]) != 0.0
  for new, old in zip(jax.tree.leaves(out[48][0]), jax.tree.leaves(out[64][0])):
    np.testing.assert_allclose(np.asarray(new), np.asarray(old), rtol=1e-5, atol=1e-6)


def spy_on_prompt_rows(monkeypatch) -> tuple[list[int], list[int]]:
  """The prompt rows of every rollout (the sampler's padded prompts) and every update (static prompt_bucket)."""
  seen, sampled = [], []
  pad = Sampler.pad_prompts

  def spying_pad(self, prompt_tokens):
    out = pad(self, prompt_tokens)
    sampled.append(out[0].shape[1])
    return out

  monkeypatch.setattr(Sampler, "pad_prompts", spying_pad)
  build = train_step.build_train_step

  def spying_build(*args, **kwargs):
    step_fn = build(*args, **kwargs)

    def step(params, opt_state, ref_params, batch, prompt_bucket=None, response_capacity=None):
      seen.append(prompt_bucket)
      return step_fn(params, opt_state, ref_params, batch, prompt_bucket, response_capacity)
    return step

  monkeypatch.setattr(loop.train_step, "build_train_step", spying_build)
  return sampled, seen


def test_a_run_with_static_weights_samples_and_updates_on_rows_of_its_data_sets_fine_bucket(tmp_path, monkeypatch):
  """The loop takes the longest prompt from the reference cache: chat-templated prompts of 36-43 tokens, whose
  power-of-two bucket is 64, go to the sampler and to the update in rows of 48."""
  sampled, seen = spy_on_prompt_rows(monkeypatch)
  cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", *TEMPLATED, "erpo.weights=static",
                                          "train.steps=2", "checkpoint.every=0", "rollout.max_new_tokens=8"])
  loop.train(cfg)
  assert sampled == [48, 48] and seen == [48, 48]
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss/total"]) for r in rows)

"""The update's prompt rows: the sampler's power-of-two bucket cut to the data set's longest prompt, with the
same update and no extra compile."""

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
from erpo_jax.train.batch import update_prompt_bucket

TEMPLATED = ["data.chat_template=true", "data.max_prompt_tokens=64", "data.levels=[1,2,3]"]


def test_prompt_rows_are_the_samplers_bucket_cut_to_the_fine_bucket_of_the_longest_prompt():
  assert update_prompt_bucket(64, 43) == 48  # the embedded default's prompts: 36-43 tokens
  assert update_prompt_bucket(64, None) == 64  # no reference cache: the sampler's bucket
  assert update_prompt_bucket(16, 43) == 16  # a batch of short prompts keeps its smaller bucket
  assert update_prompt_bucket(128, 100) == 112 and update_prompt_bucket(128, 128) == 128
  # No value the sampler's buckets do not already bring: at most one program per sampler bucket.
  for longest in (17, 43, 100, 300, 1000):
    sampler = {buckets.prompt_bucket(n, 16) for n in range(1, longest + 1)}
    cut = {update_prompt_bucket(p, longest) for p in sampler}
    assert len(cut) <= len(sampler) and max(cut) >= longest and max(cut) - longest < max(16, longest // 8 + 8)


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
  capacity = buckets.packed_capacity(N * inp.shape["response_len"], N * R, multiple=8)
  out = {P: step_fn(copy(inp.params), copy(inp.opt_state), None, inp.batch, P, capacity) for P in (64, 48)}
  for name in ("loss/total", "loss/pg", "kl/query", "optim/grad_norm", "weight/mean"):
    np.testing.assert_allclose(float(out[48][2][name]), float(out[64][2][name]), rtol=1e-5, atol=1e-7)
  assert float(out[64][2]["kl/query"]) != 0.0
  for new, old in zip(jax.tree.leaves(out[48][0]), jax.tree.leaves(out[64][0])):
    np.testing.assert_allclose(np.asarray(new), np.asarray(old), rtol=1e-5, atol=1e-6)


def spy_on_prompt_rows(monkeypatch) -> list[int]:
  """The prompt rows (static prompt_bucket) of every update the loop runs."""
  seen = []
  build = train_step.build_train_step

  def spying_build(*args, **kwargs):
    step_fn = build(*args, **kwargs)

    def step(params, opt_state, ref_params, batch, prompt_bucket=None, response_capacity=None):
      seen.append(prompt_bucket)
      return step_fn(params, opt_state, ref_params, batch, prompt_bucket, response_capacity)
    return step

  monkeypatch.setattr(loop.train_step, "build_train_step", spying_build)
  return seen


def test_a_run_with_static_weights_updates_on_rows_of_its_data_sets_fine_bucket(tmp_path, monkeypatch):
  """The loop takes the longest prompt from the reference cache: chat-templated prompts of 36-43 tokens come
  from the sampler in rows of 64 and go to the update in rows of 48."""
  seen = spy_on_prompt_rows(monkeypatch)
  cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", *TEMPLATED, "erpo.weights=static",
                                          "train.steps=2", "checkpoint.every=0", "rollout.max_new_tokens=8"])
  loop.train(cfg)
  assert seen == [48, 48]  # the sampler's bucket for 36-43 tokens: 64
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss/total"]) for r in rows)

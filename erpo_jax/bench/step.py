"""Bench of the jitted update (train_step): one synthetic rollout batch of realistic shape, compiled once, timed.

Dimension letters: B prompts, G samples per prompt, N = B*G rows, P prompt
bucket, M = max_new_tokens, S sequence length, V vocab.

The batch is what the trainer would hand the step after a rollout in which
every response ran to M tokens (the longest, hence slowest, update): the data
set's first B prompts, G copies each, then M random response tokens, trimmed
to S = min(P + M, 32-multiple above the longest row) as the trainer trims.

Variants (erpo settings, shared prefix on/off) are timed in ONE process,
taking turns on the same state and batch (`measure_steps`), so that their
ratios survive a drifting host load; the peak memory of each is measured
alone in its own process (`measure_step_memory`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from erpo_jax import buckets
from erpo_jax.bench import flops as bench_flops
from erpo_jax.bench import probe as bench_probe
from erpo_jax.bench import profile as bench_profile
from erpo_jax.model.lm_head import chunk_tokens
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.train import optim
from erpo_jax.train import step as train_step


def batch_length(prompt_len_B: np.ndarray, max_new_tokens: int, min_prompt_bucket: int) -> int:
  """S of the update batch when every response has M tokens: min(P + M, sequence_bucket(max len + M))."""
  longest = int(np.max(prompt_len_B))
  return min(buckets.prompt_bucket(longest, min_prompt_bucket) + max_new_tokens,
             buckets.sequence_bucket(longest + max_new_tokens))


def synthetic_batch(prompt_tokens: list[list[int]], group_size: int, max_new_tokens: int, length: int, *,
                    vocab: int, pad_id: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Host arrays of an update batch: prompt b in rows b*G..b*G+G-1, then M random response tokens.

  Rewards are random 0/1 (nonzero advantages in most groups), cached
  reference log-probs are random negatives at prompt positions t >= 1, static
  weights random in [0.5, 2].
  """
  rng = np.random.default_rng(seed)
  G, M, S = group_size, max_new_tokens, length
  len_N = np.repeat(np.array([len(p) for p in prompt_tokens], np.int32), G)
  N = len(len_N)
  resp_len_N = np.minimum(M, S - len_N).astype(np.int32)
  tokens = np.full((N, S), pad_id, np.int32)
  for n in range(N):
    tokens[n, :len_N[n]] = prompt_tokens[n // G]
    tokens[n, len_N[n]:len_N[n] + resp_len_N[n]] = rng.integers(0, vocab, resp_len_N[n])
  pos = np.arange(S)[None, :]
  prompt_mask = pos < len_N[:, None]
  response_mask = (pos >= len_N[:, None]) & (pos < (len_N + resp_len_N)[:, None])
  ref_logp = np.where(prompt_mask & (pos >= 1), -rng.uniform(0.0, 5.0, (N, S)), 0.0).astype(np.float32)
  return {"tokens": tokens, "prompt_mask": prompt_mask, "query_mask": prompt_mask, "response_mask": response_mask,
          "rewards": rng.integers(0, 2, N).astype(np.float32), "ref_logp": ref_logp,
          "static_weight": rng.uniform(0.5, 2.0, N).astype(np.float32),
          "truncated": np.zeros(N, bool),  # every row stays in the loss whatever ppo.mask_truncated says
          "policy_kl": np.bool_(True),  # a variant given reference params runs their forward
          "prompt_len": len_N,
          "response_len": resp_len_N}


def to_update_batch(host: dict[str, np.ndarray], mesh) -> train_step.UpdateBatch:
  """The UpdateBatch's fields taken by name from `host`, placed on their batch shardings."""
  names = [f.name for f in dataclasses.fields(train_step.UpdateBatch)]
  missing = [n for n in names if n not in host]
  if missing:
    raise RuntimeError(f"bench: UpdateBatch has fields {missing} the synthetic batch does not provide")
  return train_step.UpdateBatch(**{
      n: jax.device_put(host[n], mesh_lib.batch_sharding(mesh, host[n].ndim)) for n in names})


@dataclasses.dataclass
class StepInputs:
  """What every variant's update reads: one model state, one batch. Params and optimizer state are
  donated by each call and carried to the next, whichever variant runs it."""

  graphdef: nnx.GraphDef
  params: Any
  opt_state: Any
  ref_params: Any  # frozen copy of the initial params, for variants with erpo.reference=forward
  batch: train_step.UpdateBatch
  shape: dict[str, Any]  # B, G, N, S, prompt/response lengths
  mesh: Any
  tx: Any
  schedule: Any
  param_sh: Any
  opt_sh: Any


@dataclasses.dataclass
class StepVariant:
  """One update setting built on StepInputs."""

  cfg: Any
  step_fn: Any  # the jitted train_step.build_train_step function
  compiled: Any = None
  compile_s: float = 0.0


def prepare_inputs(cfg, model: nnx.Module, prompt_tokens: list[list[int]], *, vocab: int, pad_id: int,
                   with_reference: bool = True, seed: int = 0) -> StepInputs:
  """Shards `model`, builds the optimizer state, the reference copy and the batch as the trainer does."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.shard_model(model, mesh)
  graphdef, params = nnx.split(model)
  param_sh = mesh_lib.param_shardings(params, mesh)
  ref_params = None
  if with_reference:
    dt = jnp.bfloat16 if cfg.erpo.reference_dtype == "bfloat16" else None
    ref_params = jax.tree.map(lambda x: jnp.array(x, dtype=dt or x.dtype, copy=True), params)
  tx, schedule = optim.make_optimizer(cfg.optim, cfg.train.steps, cfg.ppo.minibatches * cfg.ppo.epochs)
  opt_sh = optim.opt_state_shardings(tx, params, param_sh, mesh)
  opt_state = optim.init_opt_state(tx, params, opt_sh)
  G, M = cfg.rollout.group_size, cfg.rollout.max_new_tokens
  len_B = np.array([len(p) for p in prompt_tokens])
  S = batch_length(len_B, M, cfg.rollout.min_prompt_bucket)
  host = synthetic_batch(prompt_tokens, G, M, S, vocab=vocab, pad_id=pad_id, seed=seed)
  shape = {"B": len(prompt_tokens), "G": G, "N": len(prompt_tokens) * G, "S": S,
           "prompt_len_mean": float(len_B.mean()), "prompt_len_max": int(len_B.max()),
           "prompt_bucket": buckets.prompt_bucket(int(len_B.max()), cfg.rollout.min_prompt_bucket),
           "response_len": int(host["response_len"].max()),
           "valid_tokens": int(host["prompt_mask"].sum() + host["response_mask"].sum())}
  return StepInputs(graphdef, params, opt_state, ref_params, to_update_batch(host, mesh), shape, mesh, tx, schedule,
                    param_sh, opt_sh)


def build_variant(inp: StepInputs, cfg) -> StepVariant:
  """The jitted update of cfg's erpo/ppo/model settings over inp's state; compiled at once."""
  step_fn = train_step.build_train_step(inp.graphdef, inp.tx, inp.schedule, cfg, mesh=inp.mesh,
                                        param_shardings=inp.param_sh, opt_shardings=inp.opt_sh,
                                        ref_shardings=inp.param_sh if train_step.takes_reference(cfg) else None)
  v = StepVariant(cfg, step_fn)
  t0 = time.perf_counter()
  v.compiled = step_fn.lower(inp.params, inp.opt_state, ref_for(inp, v), inp.batch,
                             inp.shape["prompt_bucket"]).compile()
  v.compile_s = time.perf_counter() - t0
  return v


def ref_for(inp: StepInputs, v: StepVariant):
  return inp.ref_params if train_step.takes_reference(v.cfg) else None


def compiled_memory(compiled) -> dict[str, int | None]:
  """XLA's static memory plan: scratch (temp), argument and output bytes; None where not reported."""
  try:
    m = compiled.memory_analysis()
  except (NotImplementedError, RuntimeError):  # some backends do not implement it
    m = None
  if m is None:
    return {"temp_bytes": None, "argument_bytes": None, "output_bytes": None}
  return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes)}


def run_once(inp: StepInputs, v: StepVariant):
  """One update of variant v; the donated state moves on to the outputs."""
  inp.params, inp.opt_state, metrics = v.compiled(inp.params, inp.opt_state, ref_for(inp, v), inp.batch)
  return inp.params, metrics


def time_interleaved(inp: StepInputs, variants: list[StepVariant], *, iters: int, warmup: int) -> list[list[float]]:
  """Seconds per update of each variant, the variants taking turns.

  Rounds of one call each, the starting variant rotating from round to round:
  on a shared host whose load drifts, every variant sees the same drift, so
  their ratios hold even when the absolute times move.
  """
  k = len(variants)
  for r in range(warmup):
    for v in variants:
      t = bench_probe.timed(lambda: run_once(inp, v), iters=1, warmup=0)[0]
      _progress(f"warm-up {r + 1}/{warmup}", v, t)
  times: list[list[float]] = [[] for _ in variants]
  for r in range(iters):
    for i in [(r + j) % k for j in range(k)]:
      times[i] += bench_probe.timed(lambda: run_once(inp, variants[i]), iters=1, warmup=0)
      _progress(f"round {r + 1}/{iters}", variants[i], times[i][-1])
  return times


def _progress(stage: str, v: StepVariant, seconds: float) -> None:
  e = v.cfg.erpo
  print(f"bench step {stage}: kl_on={e.kl_on} reference={e.reference} weights={e.weights} "
        f"shared_prefix={v.cfg.model.shared_prefix}: {seconds:.2f} s", file=sys.stderr, flush=True)


def _passes(v: StepVariant) -> int:
  c = v.cfg
  return bench_flops.update_passes(reference_forward=train_step.takes_reference(c),
                                   old_pass=train_step.needs_old_pass(c.ppo, c.erpo.weights), epochs=c.ppo.epochs)


def step_flops(mc, inp: StepInputs, v: StepVariant) -> float:
  """The plain layout's FLOPs: every row's [S] positions, prompt and padding included."""
  return bench_flops.forward_flops(mc, inp.shape["N"], inp.shape["S"]) * _passes(v)


def step_work_flops(mc, inp: StepInputs, v: StepVariant) -> float:
  """The update's own work (bench_flops.rl_update_flops): each prompt once, each response's valid tokens."""
  sh = inp.shape
  response_len = sh["valid_tokens"] / sh["N"] - sh["prompt_len_mean"]
  return bench_flops.rl_update_flops(mc, prompts=sh["B"], rows=sh["N"], prompt_len=sh["prompt_len_mean"],
                                     response_len=response_len, passes=_passes(v))


def _record(mc, inp: StepInputs, v: StepVariant, times: list[float]) -> dict[str, Any]:
  t = bench_probe.median(times) if times else float("nan")
  flops, work = step_flops(mc, inp, v), step_work_flops(mc, inp, v)
  c = v.cfg
  e = c.erpo
  return {
      **inp.shape, "model": c.model.path, "dtype": c.model.dtype, "param_dtype": c.model.param_dtype,
      "remat": c.model.remat, "logits_chunk": chunk_tokens(c.model.logits_chunk, mc.vocab_size), "kl_on": e.kl_on,
      "reference": e.reference, "weights": e.weights, "step_shared_prefix": c.model.shared_prefix, "time_s": t,
      "times_s": times,
      "compile_s": v.compile_s, "tokens_per_s": inp.shape["N"] * inp.shape["S"] / t,
      "valid_tokens_per_s": inp.shape["valid_tokens"] / t, "flops": flops, "flops_per_s": flops / t,
      # The shared prefix does less work for the same update: its FLOP/s are plain-layout-equivalent;
      # work_flops_per_s (and work_mfu) count only the update's own work, whichever layout ran.
      "flops_layout": "plain [N, S]", "work_flops": work, "work_flops_per_s": work / t,
      **compiled_memory(v.compiled)}


def measure_steps(cfgs: list, *, iters: int, warmup: int) -> dict[str, Any]:
  """Records of every variant's update on one model state and batch, timed interleaved in this process.

  The cfgs differ only in erpo / model.shared_prefix settings; the first one's
  model, data, rollout and optimizer sections are used for all.
  """
  window = bench_probe.host_window()
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfgs[0])
  mc = model.cfg
  need_ref = any(train_step.takes_reference(c) for c in cfgs)
  inp = prepare_inputs(cfgs[0], model, prompts, vocab=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                       with_reference=need_ref)
  variants = [build_variant(inp, c) for c in cfgs]
  times = time_interleaved(inp, variants, iters=iters, warmup=warmup)
  return {"variants": [_record(mc, inp, v, t) for v, t in zip(variants, times)], "iters": iters, "warmup": warmup,
          **bench_probe.peak_memory(), **bench_probe.device_info(), "dtype": cfgs[0].model.dtype,
          **bench_probe.host_window_fields(window)}


def measure_step_memory(cfg) -> dict[str, Any]:
  """Peak memory of one variant alone: this process loads, compiles and runs its update once.

  The first call is where the peak is reached (later calls reuse the same
  plan); its time, compilation excluded, is reported as first_call_s.
  """
  window = bench_probe.host_window()
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfg)
  inp = prepare_inputs(cfg, model, prompts, vocab=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                       with_reference=train_step.takes_reference(cfg))
  v = build_variant(inp, cfg)
  first = bench_probe.timed(lambda: run_once(inp, v), iters=1, warmup=0)
  return {"first_call_s": first[0], "compile_s": v.compile_s, **compiled_memory(v.compiled),
          **bench_probe.peak_memory(), **bench_probe.host_window_fields(window)}


def profile_step(cfg, out_dir: str, *, warmup: int) -> dict[str, Any]:
  """One traced update of cfg's variant after `warmup` (at least one) untimed ones: bench_profile.profile_call's
  totals and slowest ops, with the batch's shape and the FLOPs bench_flops counts for the update in the plain
  [N, S] layout (the shared prefix and packing run fewer)."""
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfg)
  inp = prepare_inputs(cfg, model, prompts, vocab=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
                       with_reference=train_step.takes_reference(cfg))
  v = build_variant(inp, cfg)
  for _ in range(max(1, warmup)):
    jax.block_until_ready(run_once(inp, v))
  rec = bench_profile.profile_call(lambda: run_once(inp, v), v.compiled.as_text(), out_dir)
  return {**inp.shape, **rec, "flops_plain_layout": step_flops(model.cfg, inp, v), "dtype": cfg.model.dtype,
          **bench_probe.device_info()}

"""Bench of the sampler: prefill and decode tokens/s at full length, and the uncached greedy loop beside it.

Dimension letters: B prompts, G samples per prompt, N = B*G rows, P prompt
bucket, M = max_new_tokens, T = P + M cache length, L layers, K kv heads, Dh head dim.

Every row runs to M tokens: the sampler is given a stand-in tokenizer with no
EOS ids, so no row stops early and each decode step does the same work. The
prefill time is that of a one-token `generate` (prefill plus the first draw);
decode = full `generate` minus it, over its M - 1 decode steps.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from erpo_jax import buckets
from erpo_jax.bench import flops as bench_flops
from erpo_jax.bench import probe as bench_probe
from erpo_jax.bench import workdirs
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.rollout.sampler import Sampler, greedy_reference


@dataclasses.dataclass(frozen=True)
class NoStopTokens:
  """The two tokenizer attributes a Sampler reads, with no EOS: every row decodes M tokens."""

  pad_id: int
  eos_ids: tuple[int, ...] = ()


def kv_bytes_per_step(mc, prompts: int, prompt_slots: float, rows: int, response_slots: float,
                      itemsize: int) -> float:
  """Keys and values one decode step reads: 2 L (B prompt_slots + N response_slots) K Dh bytes-per-element
  (the sampler's `GroupKVCache` holds a prompt's slots once for its G rows)."""
  slots = prompts * prompt_slots + rows * response_slots
  return 2.0 * mc.num_layers * slots * mc.num_kv_heads * mc.head_dim * itemsize


def _sampler(cfg, graphdef, pad_id: int, mesh, max_new_tokens: int, temperature: float) -> Sampler:
  r = cfg.rollout
  return Sampler(graphdef, NoStopTokens(pad_id), max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=r.top_p, top_k=r.top_k, min_prompt_bucket=r.min_prompt_bucket,
                 max_prompt_len=cfg.data.max_prompt_tokens, mesh=mesh)


def _time_generate(sampler: Sampler, params, prompts, G: int, *, iters: int, warmup: int):
  """(seconds per generate call, the last rollout); each call draws with its own key."""
  calls = {"i": 0, "last": None}

  def one():
    calls["i"] += 1
    calls["last"] = sampler.generate(params, prompts, group_size=G, key=jax.random.key(calls["i"]))
    return calls["last"]

  return bench_probe.timed(one, iters=iters, warmup=warmup), calls["last"]


def measure_sampler(cfg, *, iters: int, warmup: int) -> dict[str, Any]:
  """Prefill and decode throughput of the configured B prompts x G samples x M tokens."""
  window = bench_probe.host_window()
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfg)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.shard_model(model, mesh)
  graphdef, params = nnx.split(model)
  mc = model.cfg
  B, G, M = len(prompts), cfg.rollout.group_size, cfg.rollout.max_new_tokens
  N = B * G
  temp = cfg.rollout.temperature
  one_s, _ = _time_generate(_sampler(cfg, graphdef, tokenizer.pad_id, mesh, 1, temp), params, prompts, G,
                            iters=iters, warmup=warmup)
  full_s, rollout = _time_generate(_sampler(cfg, graphdef, tokenizer.pad_id, mesh, M, temp), params, prompts, G,
                                   iters=iters, warmup=warmup)
  prefill, total = bench_probe.median(one_s), bench_probe.median(full_s)
  decode = total - prefill
  steps = M - 1
  len_B = np.array([len(p) for p in prompts])
  P = buckets.prompt_bucket(int(len_B.max()), cfg.rollout.min_prompt_bucket)
  T = P + M
  generated = int(np.asarray(rollout.response_len).sum())
  itemsize = np.dtype(model.dtype).itemsize
  param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
  kv_valid = kv_bytes_per_step(mc, B, float(len_B.mean()), N, M / 2, itemsize)
  step_s = decode / steps if steps else float("nan")
  step_flops = bench_flops.decode_step_flops(mc, N, T)
  pre_flops = bench_flops.prefill_flops(mc, B, P)
  return {
      "B": B, "G": G, "N": N, "prompt_bucket": P, "prompt_len_mean": float(len_B.mean()),
      "max_new_tokens": M, "cache_len": T, "generated_tokens": generated, "generated_tokens_expected": N * M,
      "model": cfg.model.path, "dtype": cfg.model.dtype, "temperature": temp, "iters": iters, "warmup": warmup,
      "prefill_s": prefill, "generate_s": total, "decode_s": decode, "decode_step_s": step_s,
      "prefill_times_s": one_s, "generate_times_s": full_s,
      "prefill_tokens_per_s": B * P / prefill, "prefill_valid_tokens_per_s": float(len_B.sum()) / prefill,
      "decode_tokens_per_s": N * steps / decode if decode > 0 else float("nan"),
      "rollout_tokens_per_s": generated / total,
      "prefill_flops": pre_flops, "prefill_flops_per_s": pre_flops / prefill,
      "decode_step_flops": step_flops, "decode_flops_per_s": step_flops / step_s,
      "param_bytes": param_bytes, "kv_bytes_per_step": kv_valid,
      "kv_bytes_per_step_all_slots": kv_bytes_per_step(mc, B, P, N, M, itemsize),
      **bench_probe.peak_memory(), **bench_probe.device_info(),
      **bench_probe.host_window_fields(window)}


def measure_greedy(cfg, *, iters: int, warmup: int, prompts_max: int = 4, tokens: int = 16) -> dict[str, Any]:
  """Seconds per token step of rollout.greedy_reference (no cache) vs the cached sampler, greedy, G = 1.

  greedy_reference jits a fresh closure on every call, so a persistent
  compilation cache is switched on for this process and each timing is a
  difference of two calls (n tokens minus 1 token) over n - 1 steps: tracing
  and the cache load cancel out.
  """
  with workdirs.folder("xla") as cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return _greedy_vs_sampler(cfg, iters=iters, warmup=warmup, prompts_max=prompts_max, tokens=tokens)


def _greedy_vs_sampler(cfg, *, iters: int, warmup: int, prompts_max: int, tokens: int) -> dict[str, Any]:
  window = bench_probe.host_window()
  model, tokenizer, prompts = bench_probe.load_model_and_prompts(cfg)
  prompts = prompts[:prompts_max]
  B = len(prompts)
  n = max(2, min(tokens, cfg.rollout.max_new_tokens))

  def plain(k):
    t0 = time.perf_counter()
    greedy_reference(model, prompts, k)
    return time.perf_counter() - t0

  for _ in range(max(warmup, 1)):  # fills the compilation cache for both lengths
    plain(1)
    plain(n)
  one = [plain(1) for _ in range(iters)]
  many = [plain(n) for _ in range(iters)]
  uncached_step = (bench_probe.median(many) - bench_probe.median(one)) / (n - 1)

  mesh = mesh_lib.make_mesh(cfg.mesh)
  graphdef, params = nnx.split(model)
  s1, _ = _time_generate(_sampler(cfg, graphdef, tokenizer.pad_id, mesh, 1, 0.0), params, prompts, 1,
                         iters=iters, warmup=warmup)
  sn, _ = _time_generate(_sampler(cfg, graphdef, tokenizer.pad_id, mesh, n, 0.0), params, prompts, 1,
                         iters=iters, warmup=warmup)
  cached_step = (bench_probe.median(sn) - bench_probe.median(s1)) / (n - 1)
  return {"B": B, "G": 1, "tokens": n, "prompt_len_mean": float(np.mean([len(p) for p in prompts])),
          "model": cfg.model.path, "dtype": cfg.model.dtype, "iters": iters, "warmup": warmup,
          "uncached_step_s": uncached_step, "cached_step_s": cached_step,
          "uncached_tokens_per_s": B / uncached_step, "cached_tokens_per_s": B / cached_step,
          "cache_speedup": uncached_step / cached_step,
          **bench_probe.peak_memory(), **bench_probe.device_info(),
          **bench_probe.host_window_fields(window)}

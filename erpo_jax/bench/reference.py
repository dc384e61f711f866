"""Bench of the reference pass (`erpo-jax weights`, and a run's start with static weights or the cached
reference): every training prompt's log-probs under the reference model, prompts packed end to end.

The work counted is what the pass cannot avoid: each prompt's own tokens,
attending over their own prefix (flops.forward_flops per prompt); the packed
rows' free ends and the attention over a whole row are not counted. The
record's `fill` is the prompt tokens over the tokens the forward computes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from erpo_jax.bench import flops as bench_flops
from erpo_jax.bench import probe as bench_probe
from erpo_jax.data import reference_cache
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.model.io.loading import load_model
from erpo_jax.parallel import mesh as mesh_lib


def measure_reference(cfg, *, iters: int, warmup: int,
                      tokens_per_batch: int = reference_cache.TOKENS_PER_BATCH) -> dict[str, Any]:
  """Seconds of the whole reference pass over the config's training prompts: the first call (compiling)
  apart, then the median of `iters` after `warmup` more; useful FLOP/s and the packing's fill."""
  window = bench_probe.host_window()
  mesh = mesh_lib.make_mesh(cfg.mesh)
  model, tokenizer = load_model(cfg.model)
  mesh_lib.shard_model(model, mesh)
  prompts = [tokens for tokens, _ in dataset_prompts(cfg, tokenizer)]
  lengths = np.array([len(p) for p in prompts], np.int64)
  plan = reference_cache.plan_packing(lengths, tokens_per_batch, mesh)  # what compute_reference_logp runs

  def one():
    return reference_cache.compute_reference_logp(model, prompts, tokens_per_batch=tokens_per_batch, mesh=mesh,
                                                  chunk=cfg.model.logits_chunk, progress=False)[0]

  first = bench_probe.timed(one, iters=1, warmup=0)[0]
  times = bench_probe.timed(one, iters=iters, warmup=warmup)
  t = bench_probe.median(times)
  work = float(sum(bench_flops.forward_flops(model.cfg, 1, int(n)) for n in lengths))
  dev = jax.devices()[0]
  return {
      "prompts": len(prompts), "prompt_tokens": int(lengths.sum()), "prompt_len_max": int(lengths.max()),
      "row_len": plan.row_len, "rows": len(plan.rows), "rows_per_call": plan.rows_per_call, "calls": plan.calls,
      "fill": float(lengths.sum() / (plan.calls * plan.rows_per_call * plan.row_len)),
      "first_call_s": first, "time_s": t, "times_s": times, "iters": iters, "warmup": warmup,
      "prompts_per_s": len(prompts) / t, "useful_flops": work, "flops_per_s": work / t,
      "dtype": cfg.model.dtype, "platform": dev.platform, "device_kind": dev.device_kind,
      **bench_probe.device_info(), **bench_probe.host_window_fields(window),
  }

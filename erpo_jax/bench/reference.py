"""Bench of the reference pass (`erpo-jax weights`, and a run's start with static weights or the cached
reference): every training prompt's log-probs under the reference model, in the layout the pass picks
(`reference_layout.choose_plan`: whole prompts packed end to end, or their common prefix once and each
prompt's own tokens after it).

The work counted is what the layout cannot avoid: with whole prompts each
prompt's own tokens, attending over their own prefix (flops.forward_flops per
prompt); with the common prefix, the prefix once and each prompt's tokens after
it (its forward_flops less the prefix's). Free slots and the attention over a
whole row or suffix bucket are not counted. `fill` is the tokens the layout
needs over the tokens its forwards compute; `plain_flops` counts each prompt
alone whatever the layout, so `plain_flops / time_s` compares layouts.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from erpo_jax.bench import flops as bench_flops
from erpo_jax.bench import probe as bench_probe
from erpo_jax.data import reference_layout, reference_pass
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.model.io.loading import load_model
from erpo_jax.parallel import mesh as mesh_lib


def measure_reference(cfg, *, iters: int, warmup: int,
                      tokens_per_batch: int = reference_layout.TOKENS_PER_BATCH) -> dict[str, Any]:
  """Seconds of the whole reference pass over the config's training prompts: the first call (compiling)
  apart, then the median of `iters` after `warmup` more; useful FLOP/s and the packing's fill."""
  window = bench_probe.host_window()
  mesh = mesh_lib.make_mesh(cfg.mesh)
  model, tokenizer = load_model(cfg.model)
  mesh_lib.shard_model(model, mesh)
  prompts = [tokens for tokens, _ in dataset_prompts(cfg, tokenizer)]
  lengths = np.array([len(p) for p in prompts], np.int64)
  shared = cfg.model.shared_prefix
  plan = reference_layout.choose_plan(prompts, tokens_per_batch, mesh, shared)  # what compute_reference_logp runs

  def one():
    return reference_pass.compute_reference_logp(model, prompts, tokens_per_batch=tokens_per_batch, mesh=mesh,
                                                 chunk=cfg.model.logits_chunk, progress=False,
                                                 shared_prefix=shared)[0]

  first = bench_probe.timed(one, iters=1, warmup=0)[0]
  times = bench_probe.timed(one, iters=iters, warmup=warmup)
  t = bench_probe.median(times)
  plain = float(sum(bench_flops.forward_flops(model.cfg, 1, int(n)) for n in lengths))
  dev = jax.devices()[0]
  return {
      "prompts": len(prompts), "prompt_tokens": int(lengths.sum()), "prompt_len_max": int(lengths.max()),
      **layout_fields(model.cfg, plan, lengths, plain),
      "first_call_s": first, "time_s": t, "times_s": times, "iters": iters, "warmup": warmup,
      "prompts_per_s": len(prompts) / t, "plain_flops": plain, "plain_flops_per_s": plain / t,
      "flops_per_s": layout_work(model.cfg, plan, lengths, plain) / t,
      "dtype": cfg.model.dtype, "platform": dev.platform, "device_kind": dev.device_kind,
      **bench_probe.device_info(), **bench_probe.host_window_fields(window),
  }


def layout_work(mc, plan, lengths: np.ndarray, plain: float) -> float:
  """FLOPs the plan's layout cannot avoid (module docstring); `plain` = each prompt alone."""
  if isinstance(plan, reference_layout.PrefixPlan):
    return plain - (len(lengths) - 1) * bench_flops.forward_flops(mc, 1, plan.prefix_len)
  return plain


def layout_fields(mc, plan, lengths: np.ndarray, plain: float) -> dict[str, Any]:
  """The plan's shape, the tokens it computes, its fill and its useful work."""
  if isinstance(plan, reference_layout.PrefixPlan):
    c = plan.prefix_len
    needed = len(plan.calls) * plan.streams * c + int(lengths.sum()) - len(lengths) * c
    shape = {"layout": "prefix", "prefix_len": c, "suffix_bucket": plan.suffix_bucket, "streams": plan.streams,
             "rows_per_stream": plan.rows_per_stream, "capacity": plan.capacity, "calls": len(plan.calls)}
  else:
    needed = int(lengths.sum())
    shape = {"layout": "packed", "prefix_len": 0, "row_len": plan.row_len, "rows": len(plan.rows),
             "rows_per_call": plan.rows_per_call, "calls": plan.calls}
  return {**shape, "computed_tokens": plan.computed_tokens, "fill": needed / plan.computed_tokens,
          "useful_flops": layout_work(mc, plan, lengths, plain)}

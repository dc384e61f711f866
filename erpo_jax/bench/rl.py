"""Bench of whole RL iterations: the real training loop for warmup + iters steps, per-phase medians.

Runs `trainer.train` in this process on a throw-away run folder and reads the
per-step times the loop itself logs (time/rollout, time/reward, time/update,
time/step in metrics.jsonl, with host/page_faults and host/system_s); the first `warmup` steps
(compilation) are left out. A timed step that still compiled a program first met there (a response
capacity the warm-up did not meet; time/compile) keeps that time: the record lists each timed step's
compiling seconds (`compile_s_per_step`) and the bench prints a warning when they reach COMPILE_WARN_S.
The loop checkpoints only after its last step, outside the timed steps. The time to
the first step (time/to_first_step: set-up and compilation) is reported apart, beside
the record's `compile_cache` counts: run the bench twice for a cold and a warm cache.
update_flops and rollout_flops are the work of a step counted from the model config
and the step's logged prompt and response lengths (bench/flops.py); bench/floors.py
turns them into floors at the matmul peak.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from erpo_jax.bench import flops as bench_flops
from erpo_jax.bench import probe as bench_probe
from erpo_jax.bench import workdirs
from erpo_jax.metrics import METRICS_FILE, read_jsonl
from erpo_jax.model.io.loading import model_config
from erpo_jax.train.packing import forward_only_applies
from erpo_jax.train.step import needs_old_pass
from erpo_jax.train.loop import train

PHASES = ("time/rollout", "time/reward", "time/reference", "time/update", "time/step")
COMPILE_WARN_S = 1.0  # compiling seconds in the timed steps, in all, above which the bench warns


def bench_config(cfg, run_dir: str, steps: int):
  """cfg for `steps` logged steps in run_dir: no eval, no samples, no progress bar, no TensorBoard."""
  return dataclasses.replace(
      cfg, run=dataclasses.replace(cfg.run, dir=run_dir),
      train=dataclasses.replace(cfg.train, steps=steps, log_every=1, eval_every=0),
      checkpoint=dataclasses.replace(cfg.checkpoint, every=0),
      log=dataclasses.replace(cfg.log, progress=False, tensorboard=False, samples_every=0))


def summarize_steps(rows: list[dict], warmup: int) -> dict[str, Any]:
  """Median of each phase over the logged steps after the first `warmup`."""
  timed = [r for r in rows if r["step"] > warmup]
  out: dict[str, Any] = {"timed_steps": [r["step"] for r in timed]}
  for k in PHASES:
    vals = [r[k] for r in timed if k in r]
    out[k.replace("time/", "") + "_s"] = bench_probe.median(vals) if vals else None
  out["step_times_s"] = [r["time/step"] for r in timed]
  out["compile_s_per_step"] = [r.get("time/compile", 0.0) for r in timed]
  # The share of each update's response work on slots a larger compiled capacity padded (train/programs.py).
  out["padded_share_per_step"] = [r.get("perf/padded_share", 0.0) for r in timed]
  out["warmup_step_times_s"] = [r["time/step"] for r in rows if r["step"] <= warmup]
  # From train()'s start to the end of step 1: set-up and compilation (cold or warm compilation cache).
  out["to_first_step_s"] = rows[0].get("time/to_first_step") if rows else None
  tps = [r["perf/tokens_per_s"] for r in timed if "perf/tokens_per_s" in r]
  out["tokens_per_s"] = bench_probe.median(tps) if tps else None
  # The trainer's minor page faults and the kernel's CPU seconds per step: what memory taken back costs.
  for k in ("host/page_faults", "host/system_s"):
    vals = [r[k] for r in timed if k in r]
    out[k.replace("host/", "") + "_per_step"] = bench_probe.median(vals) if vals else None
  rl = [r["response/len_mean"] for r in timed if "response/len_mean" in r]
  out["response_len_mean"] = sum(rl) / len(rl) if rl else None
  # Groups whose rewards are all equal: with forward-only uniform groups, their responses skip the backward.
  z = [r["reward/zero_std_groups"] for r in timed if "reward/zero_std_groups" in r]
  out["zero_std_groups_mean"] = sum(z) / len(z) if z else None
  return out


def work_per_step(cfg, mc, rows: list[dict]) -> dict[str, Any]:
  """Medians over `rows` (the timed steps' metrics) of the update's and the rollout's FLOPs."""
  B, G = cfg.data.batch_size, cfg.rollout.group_size
  passes = bench_flops.update_passes(reference_forward=cfg.erpo.reference == "forward",
                                     old_pass=needs_old_pass(cfg.ppo, cfg.erpo.weights), epochs=cfg.ppo.epochs)
  lengths = [r for r in rows if "prompt/len_mean" in r and "response/len_mean" in r]
  if not lengths:
    return {}
  # A cached-reference step that logs the Policy-KL runs one reference forward more.
  extra = lambda r: int(cfg.erpo.reference == "cached" and "kl/policy" in r)
  # Uniform groups run forward-only where model.forward_only_uniform_groups applies.
  forward_only = lambda r: B * G * r.get("reward/zero_std_groups", 0.0) if forward_only_applies(cfg) else 0.0
  update = [bench_flops.rl_update_flops(mc, prompts=B, rows=B * G, prompt_len=r["prompt/len_mean"],
                                        response_len=r["response/len_mean"], passes=passes + extra(r),
                                        forward_only_rows=forward_only(r))
            for r in lengths]
  rollout = [bench_flops.rl_rollout_flops(mc, prompts=B, rows=B * G, prompt_len=r["prompt/len_mean"],
                                          decode_steps=int(r["response/len_max"])) for r in lengths]
  return {"update_flops": bench_probe.median(update), "update_passes": passes,
          "rollout_flops": bench_probe.median(rollout),
          "prompt_len_mean": sum(r["prompt/len_mean"] for r in lengths) / len(lengths)}


def measure_rl(cfg, *, iters: int, warmup: int) -> dict[str, Any]:
  """Median per-phase step times of `iters` real training steps after `warmup`, and peak RSS."""

  window = bench_probe.host_window()
  with workdirs.folder("rl") as run_dir:
    train(bench_config(cfg, str(run_dir / "run"), warmup + iters))
    rows = read_jsonl(run_dir / "run" / METRICS_FILE)
  out = {"B": cfg.data.batch_size, "G": cfg.rollout.group_size, "N": cfg.data.batch_size * cfg.rollout.group_size,
         "max_new_tokens": cfg.rollout.max_new_tokens, "model": cfg.model.path, "dtype": cfg.model.dtype,
         "kl_on": cfg.erpo.kl_on, "reference": cfg.erpo.reference, "weights": cfg.erpo.weights,
         "policy_kl_every": cfg.log.policy_kl_every, "shared_prefix": cfg.model.shared_prefix, "iters": iters,
         "warmup": warmup,
         **summarize_steps(rows, warmup),
         **work_per_step(cfg, model_config(cfg.model), [r for r in rows if r["step"] > warmup]),
         **bench_probe.peak_memory(), **bench_probe.device_info(),
         **bench_probe.host_window_fields(window)}
  warning = compile_warning(out)
  if warning:
    print(warning, file=sys.stderr, flush=True)
  return out


def compile_warning(rec: dict[str, Any]) -> str | None:
  """The warning line of an rl record whose timed steps compiled programs for COMPILE_WARN_S or more."""
  compiling = [(step, s) for step, s in zip(rec["timed_steps"], rec["compile_s_per_step"]) if s >= 0.1]
  total = sum(s for _, s in compiling)
  if total < COMPILE_WARN_S:
    return None
  where = ", ".join(f"step {step} {s:.1f} s" for step, s in compiling)
  return (f"warning: bench rl: {len(compiling)} of {len(rec['timed_steps'])} timed steps compiled programs first "
          f"met there ({where}) and their times include it; the compilation cache loads them next time: run "
          f"the bench again, or give it more --warmup steps")

"""One bench measurement in a fresh process: `python -m erpo_jax.bench.worker SPEC.json OUT.json`.

SPEC holds {"kind": device|steps|step_memory|step_profile|rollout|greedy|rl|reference, "config": a
YAML file (a list of them for steps), "iters": int, "warmup": int, and for step_profile "out": a folder}; OUT
receives the measurement's JSON record. A process per measurement makes its
peak memory (ru_maxrss, the device's peak_bytes_in_use) that of this
measurement alone. Each uses the persistent compilation cache as the CLI
does (erpo_jax.compile_cache; ERPO_JAX_CACHE_DIR=off for cold compiles), and its
record says how many programs it loaded from it (`compile_cache`).
"""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp

from erpo_jax import compile_cache
from erpo_jax.bench import probe as bench_probe
from erpo_jax.bench.reference import measure_reference
from erpo_jax.bench.rl import measure_rl
from erpo_jax.bench.rollout import measure_greedy, measure_sampler
from erpo_jax.bench.step import measure_step_memory, measure_steps, profile_step
from erpo_jax.config_io import load_config


def with_local_peaks(record: dict, *, bandwidth: bool) -> dict:
  """Adds the matmul peak of the record's dtype, the cost of fresh memory (`probe.first_touch_s_per_gib`) and
  (asked) the read bandwidth, measured here, just after it.

  The host is shared: a peak taken minutes earlier in another process may
  have seen another load. Taken after the record's peak memory was read.
  """
  n = 8192 if record["platform"] != "cpu" else 2048
  dtype = jnp.bfloat16 if record["dtype"] == "bfloat16" else jnp.float32
  record["local_peak_flops_per_s"] = bench_probe.matmul_peak(n, dtype)["flops_per_s"]
  record["local_first_touch_s_per_gib"] = bench_probe.first_touch_s_per_gib()
  if bandwidth:
    size = (1 << 30) if record["platform"] != "cpu" else (256 << 20)
    record["local_read_bytes_per_s"] = bench_probe.read_bandwidth(size)["read_bytes_per_s"]
  return record


def measure(kind: str, cfg, *, iters: int, warmup: int, out: str | None = None) -> dict:
  """The record of one measurement, run in this process; cfg is a list of configs for `steps`; `out` is
  step_profile's folder."""

  if kind == "device":
    return {**bench_probe.device_peaks(), **bench_probe.device_info(), "load_avg": bench_probe.load_average()}
  if kind == "steps":
    return with_local_peaks(measure_steps(cfg, iters=iters, warmup=warmup), bandwidth=False)
  if kind == "step_memory":
    return measure_step_memory(cfg)
  if kind == "step_profile":
    return with_local_peaks(profile_step(cfg, out, warmup=warmup), bandwidth=False)
  if kind == "rollout":
    return with_local_peaks(measure_sampler(cfg, iters=iters, warmup=warmup), bandwidth=True)
  if kind == "greedy":
    return measure_greedy(cfg, iters=iters, warmup=warmup)
  if kind == "rl":
    return with_local_peaks(measure_rl(cfg, iters=iters, warmup=warmup), bandwidth=False)
  if kind == "reference":
    return with_local_peaks(measure_reference(cfg, iters=iters, warmup=warmup), bandwidth=False)
  raise ValueError(f"bench worker: unknown kind {kind!r}")


def main(argv: list[str]) -> int:

  spec_path, out_path = argv
  with open(spec_path, encoding="utf-8") as f:
    spec = json.load(f)
  if spec["kind"] != "greedy":  # greedy sets up a cache of its own, in a temporary folder
    compile_cache.setup()
  paths = spec["config"]
  cfg = [load_config(p) for p in paths] if isinstance(paths, list) else (load_config(paths) if paths else None)
  record = measure(spec["kind"], cfg, iters=spec["iters"], warmup=spec["warmup"], out=spec.get("out"))
  record["compile_cache"] = compile_cache.stats()
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump(record, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""`erpo-jax bench [step|rollout|rl|reference|all]`: one JSON line per measurement, each run in its own process.

    erpo-jax bench step --config configs/bench_reference.yaml [--variants ce]
    erpo-jax bench rollout --config configs/bench_reference.yaml
    erpo-jax bench rl --config configs/bench_reference.yaml [--against trl.json]   # ratios over a peer
    erpo-jax bench reference --config configs/default.yaml   # the reference pass of erpo-jax weights

Every run first measures the device itself (`device` line: float32 and
bfloat16 matmul FLOP/s, read bandwidth), then each measurement in a fresh
process (erpo_jax.bench.worker) so that its peak memory is its own. The step
variants are timed taking turns in one process (ratios fair under a drifting
load) and each is run once more alone for its peak memory. The
step and rollout workers measure the matmul peak (and read bandwidth) again
right after their timed runs, since the shared host's load drifts. The parent
adds utilisation (achieved FLOP/s over the matmul peak of the compute dtype)
and memory-bandwidth floors, prints each record as it comes, and ends with a
`summary` line of ratios: a step variant's over (c) as the ratio of their
medians and, `..._paired`, as the median of the rounds' own ratios.

step: the update on the same N x S batch in four settings:
  (a) ERPO, reference forward in the step (kl_on=prompt, reference=forward, weights=static)
  (b) ERPO, cached reference prompt log-probs (kl_on=prompt, reference=cached, weights=static)
  (c) GRPO, k3 policy-KL on responses (kl_on=response, reference=forward, weights=none)
  (d) no KL (kl_on=none, weights=none, reference=cached: no reference forward)
  (e) as (b), plus a reference forward for kl/policy in every step
each with model.shared_prefix off and on when the step reads that field
(--variants and --shared-prefix pick some of them).
rollout: sampler prefill / decode tokens/s, and the uncached greedy loop.
rl: whole iterations of the training loop (bench_rl); with a peer's summary
(`against`, bench/peer.py) also erpo-jax's figures over the peer's.
reference: the reference pass over the training prompts (bench/reference.py), its
useful FLOP/s over the matmul peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

from erpo_jax.bench import machine
from erpo_jax.bench.floors import with_decode_floors, with_rl_floors, with_spec_peaks, with_utilisation
from erpo_jax.bench import peer as bench_peer
from erpo_jax.bench import profile as bench_profile
from erpo_jax.bench import workdirs
from erpo_jax.bench.ratios import summary
from erpo_jax.config import Config
from erpo_jax.config_io import dump_config

WHAT = ("step", "rollout", "rl", "reference", "all")
# (iters, warmup) when not given; rl: the median of 6 steps after 2.
DEFAULT_ITERS = {"step": (3, 1), "rollout": (3, 1), "rl": (6, 2), "reference": (3, 1)}
# variant -> (label, erpo settings)
STEP_VARIANTS = {
    "a": ("erpo_reference_forward", {"kl_on": "prompt", "reference": "forward", "weights": "static"}),
    "b": ("erpo_reference_cached", {"kl_on": "prompt", "reference": "cached", "weights": "static"}),
    "c": ("grpo_policy_kl", {"kl_on": "response", "reference": "forward", "weights": "none"}),
    "d": ("no_kl", {"kl_on": "none", "reference": "cached", "weights": "none"}),
    "e": ("erpo_cached_policy_kl", {"kl_on": "prompt", "reference": "cached", "weights": "static"}),
}


def step_variant(cfg: Config, variant: str, shared_prefix: bool | None) -> Config:
  """cfg with the erpo settings of `variant` (and model.shared_prefix when not None)."""
  cfg = dataclasses.replace(cfg, erpo=dataclasses.replace(cfg.erpo, **STEP_VARIANTS[variant][1]))
  if cfg.erpo.reference == "cached":  # the reference forward for kl/policy: in (e) only
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, policy_kl_every=int(variant == "e")))
  if shared_prefix is not None:
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, shared_prefix=shared_prefix))
  return cfg


# ----------------------------------------------------------------------------- workers


def run_worker(kind: str, cfg: Config | list[Config] | None, *, iters: int, warmup: int,
               tmp: str, out: str | None = None) -> dict[str, Any]:
  """Runs erpo_jax.bench.worker in a fresh Python process; its output goes to our stderr.

  Returns its record, or {"error": ...} when it failed (the bench goes on).
  """
  fd, spec_path = tempfile.mkstemp(suffix=".json", dir=tmp)
  os.close(fd)
  stem = spec_path[:-5]
  cfgs = cfg if isinstance(cfg, list) else ([] if cfg is None else [cfg])
  cfg_paths = []
  for i, c in enumerate(cfgs):
    cfg_paths.append(f"{stem}.{i}.yaml")
    with open(cfg_paths[-1], "w", encoding="utf-8") as f:
      f.write(dump_config(c))
  with open(spec_path, "w", encoding="utf-8") as f:
    config = cfg_paths if isinstance(cfg, list) else (cfg_paths[0] if cfg_paths else None)
    json.dump({"kind": kind, "config": config, "iters": iters, "warmup": warmup, "out": out}, f)
  out_path = f"{stem}.out.json"
  # stdout=2: whatever the worker prints (logs, progress) stays off our stdout, which holds only JSON lines.
  proc = subprocess.run([sys.executable, "-m", "erpo_jax.bench.worker", spec_path, out_path], stdout=2,
                        check=False)
  if proc.returncode != 0 or not os.path.exists(out_path):
    return {"error": f"bench worker '{kind}' exited with code {proc.returncode} (its log is on stderr above)"}
  with open(out_path, encoding="utf-8") as f:
    return json.load(f)


SHARED_PREFIX = {"off": (False,), "on": (True,), "both": (False, True)}


def step_records(cfg: Config, *, iters: int, warmup: int, tmp: str, device: dict[str, Any],
                 variants: str = "abcd", shared_prefix: str = "both"):
  """Yields the step lines: times from one interleaved process, peak memory from one process per variant."""
  keys = [(v, sp) for sp in SHARED_PREFIX[shared_prefix] for v in STEP_VARIANTS if v in variants]
  cfgs = [step_variant(cfg, v, sp) for v, sp in keys]
  timing = run_worker("steps", cfgs, iters=iters, warmup=warmup, tmp=tmp)
  for i, ((v, sp), c) in enumerate(zip(keys, cfgs)):
    name = f"step/{v}/shared_prefix_{'on' if sp else 'off'}"
    rec: dict[str, Any] = {"name": name, "variant": v, "label": STEP_VARIANTS[v][0], "shared_prefix": sp}
    if "error" in timing:
      rec["error"] = timing["error"]
    else:
      rec.update(timing["variants"][i])
      rec.update({k: timing[k] for k in ("iters", "warmup", "platform", "device_kind", "cpu_model", "cpu_isa",
                                         "xla_max_isa", "host_cpus", "local_peak_flops_per_s", "load_avg_start",
                                         "load_avg_end", "steal_share", "compile_cache")})
      rec["timing_process_peak_rss_bytes"] = timing["peak_rss_bytes"]
      with_utilisation(rec, device, "flops_per_s", "utilisation")
      with_utilisation(rec, device, "work_flops_per_s", "work_utilisation")
    mem = run_worker("step_memory", c, iters=1, warmup=0, tmp=tmp)
    if "error" in mem:
      rec["memory_error"] = mem["error"]
    else:
      rec.update({"peak_rss_bytes": mem["peak_rss_bytes"], "peak_device_bytes": mem["peak_device_bytes"],
                  "alone_first_call_s": mem["first_call_s"], "alone_load_avg": mem["load_avg_end"]})
    yield rec


def profile_records(cfg: Config, *, warmup: int, tmp: str, device: dict[str, Any], folder: str,
                    variants: str = "abcd", shared_prefix: str = "both"):
  """Yields one `profile/...` line per step variant: a traced update written to folder/<variant>_shared_prefix_<on|off>
  (bench/profile.py), with the matmul ops' FLOP/s over the matmul peak (`matmul_utilisation`)."""
  for sp in SHARED_PREFIX[shared_prefix]:
    for v in (v for v in STEP_VARIANTS if v in variants):
      tag = f"{v}/shared_prefix_{'on' if sp else 'off'}"
      rec: dict[str, Any] = {"name": f"profile/{tag}", "variant": v, "label": STEP_VARIANTS[v][0],
                             "shared_prefix": sp}
      got = run_worker("step_profile", step_variant(cfg, v, sp), iters=1, warmup=warmup, tmp=tmp,
                       out=os.path.join(folder, tag.replace("/", "_")))
      rec.update(got)
      if "error" not in got:
        with_utilisation(rec, device, "matmul_flops_per_s", "matmul_utilisation")
        table = os.path.join(rec["dir"], "ops.txt")
        print(f"bench profile {tag}: {rec['wall_s']:.2f} s, matmul ops {rec['matmul_s']:.2f} s "
              f"at {rec['matmul_flops_per_s'] / 1e9 if rec['matmul_flops_per_s'] else 0:.1f} GFLOP/s, other ops "
              f"{rec['other_s']:.2f} s; every op: {table}", file=sys.stderr, flush=True)
        bench_profile.mark_above_peak(rec, tag)
      yield rec


def _clean(x):
  """JSON-safe and short: NaN/Inf -> null, floats to 5 significant digits."""
  if isinstance(x, float):
    return None if not math.isfinite(x) else float(f"{x:.5g}")
  if isinstance(x, dict):
    return {k: _clean(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_clean(v) for v in x]
  return x


def emit(rec: dict[str, Any], out: str | None = None) -> None:
  """Prints rec as one JSON line; also appends it to the file `out` when given."""
  line = json.dumps(_clean(rec))
  print(line, flush=True)
  if out is not None:
    with open(out, "a", encoding="utf-8") as f:
      f.write(line + "\n")


# ----------------------------------------------------------------------------- entry point


def run_bench(cfg: Config, *, what: str = "all", iters: int | None = None, warmup: int | None = None,
              against: dict[str, Any] | None = None, out: str | None = None, variants: str = "abcd",
              shared_prefix: str = "both", peak_flops: float | None = None,
              peak_bandwidth: float | None = None, profile: str | None = None) -> list[dict[str, Any]]:
  """Prints one JSON line per measurement and a summary line; returns the same records, summary last.

  against: a peer's figures (bench_peer.load_peer), compared with the rl
  record in an `against` record and on stderr. out: a file that receives the
  same JSON lines (it is started afresh). variants, shared_prefix: the step
  variants to run (letters of STEP_VARIANTS) and with which model.shared_prefix
  (off, on, both). peak_flops, peak_bandwidth: the device's
  data-sheet bfloat16 FLOP/s and memory bytes/s for MFU and floors, where
  bench/machine.py does not know its device_kind. profile: with step, a folder
  that receives one traced update of each variant (profile_records), after the timings.
  """
  if what not in WHAT:
    raise ValueError(f"bench: what must be one of {WHAT}, got {what!r}")
  kinds = ("step", "rollout", "rl", "reference") if what == "all" else (what,)
  records: list[dict[str, Any]] = []
  if out is not None:
    open(out, "w", encoding="utf-8").close()

  def record(name: str, rec: dict[str, Any], **fields) -> dict[str, Any]:
    rec = {"name": name, **fields, **rec}
    records.append(rec)
    emit(rec, out)
    warning = machine.steal_warning(rec)
    if warning:
      print(warning, file=sys.stderr, flush=True)
    return rec

  workdirs.announce_stale_removed()  # folders of bench runs killed before they could remove them
  with workdirs.folder("run") as run_folder:
    tmp = str(run_folder)
    device = record("device", with_spec_peaks(run_worker("device", None, iters=1, warmup=1, tmp=tmp),
                                              peak_flops=peak_flops, peak_bandwidth=peak_bandwidth))
    for kind in kinds:
      n, w = DEFAULT_ITERS[kind]
      n, w = (n if iters is None else iters), (w if warmup is None else warmup)
      if kind == "step":
        for rec in step_records(cfg, iters=n, warmup=w, tmp=tmp, device=device, variants=variants,
                                shared_prefix=shared_prefix):
          record(rec.pop("name"), rec)
        if profile is not None:
          for rec in profile_records(cfg, warmup=w, tmp=tmp, device=device, folder=profile, variants=variants,
                                     shared_prefix=shared_prefix):
            record(rec.pop("name"), rec)
      elif kind == "rollout":
        rec = run_worker("rollout", cfg, iters=n, warmup=w, tmp=tmp)
        with_utilisation(rec, device, "prefill_flops_per_s", "prefill_utilisation")
        with_utilisation(rec, device, "decode_flops_per_s", "decode_utilisation")
        with_decode_floors(rec, device)
        record("rollout/sampler", rec)
        record("rollout/greedy_uncached", run_worker("greedy", cfg, iters=n, warmup=w, tmp=tmp))
      elif kind == "reference":
        rec = run_worker("reference", cfg, iters=n, warmup=w, tmp=tmp)
        with_utilisation(rec, device, "flops_per_s", "utilisation")
        record("reference", rec)
      else:
        rec = run_worker("rl", cfg, iters=n, warmup=w, tmp=tmp)
        with_rl_floors(rec, device)
        rec = record("rl", rec)
        if against is not None and "error" not in rec:
          vs = record("against", bench_peer.compare(rec, against, rec.get("cpu_model") or machine.cpu_model()))
          for line in bench_peer.report(vs):
            print(line, file=sys.stderr, flush=True)
  records.append(summary(records))
  emit(records[-1], out)
  return records

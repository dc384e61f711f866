"""`erpo-jax bench rl --against FILE`: erpo-jax's figures over a peer's, both measured on one machine.

FILE is what scripts/peers/trl_grpo_bench.py writes with --json-out
({"summary": ..., "per_step": ...}), its summary object alone, or its log,
whose last `SUMMARY_JSON {...}` line is read; or what an earlier `erpo-jax
bench rl --out FILE` wrote, whose last `rl` record is read: another mode
(ERPO against GRPO) or another commit, measured on this machine. The ratios
(erpo-jax / peer; below 1: erpo-jax is faster or smaller), each of medians
over the timed steps:

  step      whole step                          / step_wall_s
  rollout   rollout: sampling the responses     / generate_s
  update    reference phase + update            / ref_logps_fwd_s + update_s
  peak_rss  peak RSS (trainer or a verifier)    / peak_rss_mb

  work      rollout + update FLOPs              / the same (against erpo-jax only)

`work` is the step's time ratio if both steps ran at one time per FLOP.
TRL computes the reference log-probs inside its rollout and erpo-jax inside
its update (or from a cache), so `update` adds the reference's time on both
sides. Rewards are left out of rollout and update on both sides (in step).
Absolute times differ a lot between machines, so each side says where it ran.
"""

from __future__ import annotations

import json
import math
from typing import Any

from erpo_jax import allocator
from erpo_jax.bench import machine
from erpo_jax.errors import DataError, PathError

SCRIPT = "scripts/peers/trl_grpo_bench.py"
# Dotted paths of the summary figures the ratios read.
PEER_KEYS = ("step_wall_s.median", "generate_s.median", "ref_logps_fwd_s.median", "update_s.median", "peak_rss_mb")
RATIOS = ("step", "rollout", "update", "peak_rss")


def _summary_of(text: str) -> Any:
  """The summary object in a --json-out file, a bare summary, or the last SUMMARY_JSON line of a log."""
  lines = [line for line in text.splitlines() if line.startswith("SUMMARY_JSON ")]
  if lines:
    return json.loads(lines[-1][len("SUMMARY_JSON "):])
  if not text.strip():
    raise ValueError("neither a JSON object nor a log with a 'SUMMARY_JSON {...}' line")
  obj = json.loads(text)
  return obj["summary"] if isinstance(obj, dict) and isinstance(obj.get("summary"), dict) else obj


def _figure(summary: dict, key: str, path: str) -> float:
  value: Any = summary
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      raise DataError(f"--against '{path}': missing key '{key}' (expected the summary JSON of {SCRIPT})")
    value = value[part]
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise DataError(f"--against '{path}': key '{key}' is {value!r}, expected a positive number")
  return float(value)


def _text(x: Any) -> str | None:
  return x if isinstance(x, str) and x else None


def _mode(rec: dict) -> str:
  # A cached reference runs the reference forward for the Policy-KL metric every `policy_kl_every` steps.
  every = (f", Policy-KL every {rec['policy_kl_every']}" if rec.get("reference") == "cached"
           and rec.get("policy_kl_every") else "")
  return (f"erpo-jax (kl_on {rec.get('kl_on')}, reference {rec.get('reference')}, weights {rec.get('weights')}"
          f"{every})")


def _work(rec: dict) -> float | None:
  """A bench rl record's rollout + update FLOPs per step (None when it has no count)."""
  flops = [rec.get("rollout_flops"), rec.get("update_flops")]
  return sum(flops) if all(isinstance(f, (int, float)) and f > 0 for f in flops) else None


def _rl_record(text: str) -> dict | None:
  """The last `rl` record of a `bench rl --out` file (JSON lines), or None when the text is not one."""
  found = None
  for line in filter(str.strip, text.splitlines()):
    try:
      obj = json.loads(line)
    except ValueError:
      return None
    if isinstance(obj, dict) and obj.get("name") == "rl":
      found = obj
  return found


def _load_rl(rec: dict, path: str) -> dict[str, Any]:
  """An earlier `bench rl` record as the peer: its medians in the peer summary's keys, its work, its machine."""
  def number(key: str) -> float:  # positive; the reference phase may take no time (a cached reference)
    v = rec.get(key)
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        or not (v >= 0 if key == "reference_s" else v > 0)):
      raise DataError(f"--against '{path}': the rl record's '{key}' is {v!r}, expected a positive number"
                      + (" (its measurement failed: run it again)" if "error" in rec else ""))
    return float(v)
  rss = max(number("peak_rss_bytes"), rec.get("peak_children_rss_bytes") or 0)
  return {"file": path, "framework": _mode(rec), "device": rec.get("platform"),
          "cpu_model": _text(rec.get("cpu_model")), "host_cpus": rec.get("host_cpus"),
          "isa": _text(rec.get("xla_max_isa") or rec.get("cpu_isa")), "allocator": _text(rec.get("allocator")),
          "allocator_env": {}, "freed_memory": _text(rec.get("freed_memory")), "work_flops": _work(rec),
          "figures": {"step_wall_s.median": number("step_s"), "generate_s.median": number("rollout_s"),
                      "ref_logps_fwd_s.median": number("reference_s"), "update_s.median": number("update_s"),
                      "peak_rss_mb": rss / 2 ** 20}}


def load_peer(path: str) -> dict[str, Any]:
  """The peer's figures and where they were measured; one-line PathError / DataError naming the file and key."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise PathError(f"--against '{path}': {e.strerror or e}") from None
  except UnicodeDecodeError:
    raise DataError(f"--against '{path}': not UTF-8 text (expected the summary JSON of {SCRIPT})") from None
  rl = _rl_record(text)
  if rl is not None:
    return _load_rl(rl, path)
  try:
    summary = _summary_of(text)
  except (ValueError, RecursionError) as e:
    raise DataError(f"--against '{path}': not the summary JSON of {SCRIPT} ({e})") from None
  if not isinstance(summary, dict):
    raise DataError(f"--against '{path}': expected a JSON object (the summary of {SCRIPT}), "
                    f"got {type(summary).__name__}")
  host = summary.get("host") if isinstance(summary.get("host"), dict) else {}
  cpu, isa, alloc = host.get("cpu_model"), host.get("torch_cpu_capability"), host.get("allocator")
  alloc_env = host.get("allocator_env") if isinstance(host.get("allocator_env"), dict) else {}
  freed = allocator.freed_memory(alloc_env, alloc) if alloc == "mimalloc" else None
  return {"file": path, "framework": str(summary.get("framework", "peer")), "device": summary.get("device"),
          "cpu_model": _text(cpu), "host_cpus": host.get("cpus"), "isa": _text(isa),
          "allocator": _text(alloc),  # absent from summaries written before the harness recorded it
          "allocator_env": alloc_env, "freed_memory": freed if freed != "returned" else None,
          "figures": {k: _figure(summary, k, path) for k in PEER_KEYS}}


def _ratio(a: float | None, b: float) -> float | None:
  return None if a is None else a / b


def _malloc(name: str) -> str:
  return "the C library's malloc" if name == "system" else name


def compare(rl: dict[str, Any], peer: dict[str, Any], cpu_model: str) -> dict[str, Any]:
  """The `against` record: both sides' figures, their ratios, the machines, and warnings when they differ.

  rl is the `bench rl` record (step_s, rollout_s, reference_s, update_s,
  peak_rss_bytes, peak_children_rss_bytes, platform, device_kind); cpu_model
  is this machine's.
  """
  f = peer["figures"]
  ref_update = None if rl.get("reference_s") is None or rl.get("update_s") is None else (
      rl["reference_s"] + rl["update_s"])
  ours = {"step_s": rl.get("step_s"), "rollout_s": rl.get("rollout_s"), "reference_plus_update_s": ref_update,
          "peak_rss_bytes": max(rl["peak_rss_bytes"], rl.get("peak_children_rss_bytes") or 0)}
  theirs = {"step_s": f["step_wall_s.median"], "rollout_s": f["generate_s.median"],
            "reference_plus_update_s": f["ref_logps_fwd_s.median"] + f["update_s.median"],
            "peak_rss_bytes": f["peak_rss_mb"] * 2 ** 20}
  ratios = {name: _ratio(ours[k], theirs[k]) for name, k in zip(RATIOS, ours)}
  if "work_flops" in peer:  # an erpo-jax record: the ratio of the two steps' work too
    ours["work_flops"], theirs["work_flops"] = _work(rl), peer["work_flops"]
    ratios["work"] = None if None in (ours["work_flops"], theirs["work_flops"]) else (
        ours["work_flops"] / theirs["work_flops"])
  platform, kind = rl.get("platform", "cpu"), rl.get("device_kind", "")
  warnings = []
  if peer["cpu_model"] is None:
    warnings.append(f"'{peer['file']}' does not name the CPU it was measured on; the ratios assume it was this "
                    f"machine's ({cpu_model})")
  elif peer["cpu_model"] != cpu_model:
    warnings.append(f"the peer was measured on '{peer['cpu_model']}' and erpo-jax on '{cpu_model}': the ratios "
                    f"compare different machines")
  isa = rl.get("xla_max_isa") or rl.get("cpu_isa")
  ours_isa, peer_isa = machine.isa_family(isa), machine.isa_family(peer["isa"])
  if platform == "cpu" and ours_isa and peer_isa and ours_isa != peer_isa:
    warnings.append(f"erpo-jax's CPU code ran as {ours_isa} and the peer's torch kernels as {peer_isa}: the ratios "
                    f"compare different instruction sets")
  ours_alloc, peer_alloc = rl.get("allocator"), peer["allocator"]
  if platform == "cpu" and ours_alloc and peer_alloc and ours_alloc != peer_alloc:
    warnings.append(f"erpo-jax ran on {_malloc(ours_alloc)} and the peer on {_malloc(peer_alloc)}: the ratios "
                    f"include the allocators' difference (scripts/peers/README.md runs the peer on mimalloc)")
  if peer["device"] is not None and peer["device"] != platform:
    warnings.append(f"erpo-jax ran on {platform} ({kind}) and the peer on {peer['device']}: the ratios compare "
                    f"different devices")
  return {"peer": peer["framework"], "erpo_jax_mode": _mode(rl) if "work_flops" in peer else "erpo-jax",
          "file": peer["file"], "ratios": ratios, "erpo_jax": ours, "peer_figures": theirs,
          "machine": {"erpo_jax": {"cpu_model": cpu_model, "platform": platform, "device_kind": kind, "isa": isa,
                                   "allocator": ours_alloc, "freed_memory": rl.get("freed_memory")},
                      "peer": {"cpu_model": peer["cpu_model"], "device": peer["device"], "cpus": peer["host_cpus"],
                               "isa": peer["isa"], "allocator": peer_alloc, "allocator_env": peer["allocator_env"],
                               "freed_memory": peer["freed_memory"]}},
          "warnings": warnings}


def report(rec: dict[str, Any]) -> list[str]:
  """Human lines of an `against` record (the bench prints them on stderr): warnings, then the ratios."""
  own = "work" in rec["ratios"]  # against an earlier erpo-jax run: ratios near 1, so three digits
  shown = ", ".join(f"{name.replace('_rss', ' RSS')} {v:.{3 if own else 2}f}x" for name, v in rec["ratios"].items()
                    if v is not None)
  m = rec["machine"]
  def on(side: dict[str, Any], device: str | None) -> str:
    freed = str(side.get("freed_memory") or "")
    kept = f"freed memory {freed}" if freed.startswith("kept") else None
    return ", ".join(x for x in (device or "unknown", side.get("isa"), side.get("allocator"), kept) if x)

  where = (f"{'this run' if own else 'erpo-jax'} on {m['erpo_jax']['cpu_model']} "
           f"({on(m['erpo_jax'], m['erpo_jax']['platform'])}), {'the earlier run' if own else rec['peer']} on "
           f"{m['peer']['cpu_model'] or 'an unnamed CPU'} ({on(m['peer'], m['peer']['device'])})")
  return ([f"warning: {w}" for w in rec["warnings"]]
          + [f"bench --against {rec['file']}: {rec.get('erpo_jax_mode', 'erpo-jax')} / {rec['peer']}: "
             f"{shown or 'no figures'}; {where}"])

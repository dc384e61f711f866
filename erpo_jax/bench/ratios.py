"""The bench's closing `summary` line: ratios across its records.

A step variant's time over (c)'s, and the shared prefix's speedup, each as the ratio of two medians and, where
the variants were timed taking turns in one process, as the median of the rounds' own ratios (`..._paired`);
the rl record's figures; the peer ratios of an `against` record.
"""

from __future__ import annotations

import os
import statistics
from typing import Any


def paired_ratio(rec: dict[str, Any], base: dict[str, Any]) -> float | None:
  """The median over rounds of rec's time over base's in the same round, where both were timed taking turns in
  one process (`times_s`, one per round). A host whose speed drifts by more than the variants differ moves
  both times of a round together: the ratio of the two medians can then differ from the rounds' own ratios."""
  a, b = rec.get("times_s"), base.get("times_s")
  if not a or not b or len(a) != len(b):
    return None
  return statistics.median(x / y for x, y in zip(a, b))


def _put_ratio(out: dict[str, Any], key: str, rec: dict[str, Any], base: dict[str, Any]) -> None:
  """out[key] = rec's median time over base's, and out[key + "_paired"] where their rounds pair up."""
  out[key] = rec["time_s"] / base["time_s"]
  paired = paired_ratio(rec, base)
  if paired is not None:
    out[f"{key}_paired"] = paired


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
  """Ratios across the measurements: step times over (c), rl figures over the peer's (an `against` record)."""
  out: dict[str, Any] = {"name": "summary"}
  steps = {(r["variant"], r.get("shared_prefix")): r for r in records
           if r["name"].startswith("step/") and "time_s" in r}
  for sp in sorted({k[1] for k in steps}, key=str):
    suffix = "" if sp is None else f"_shared_prefix_{'on' if sp else 'off'}"
    c = steps.get(("c", sp))
    for v in "abde":
      if c and (v, sp) in steps:
        _put_ratio(out, f"step_{v}_over_c{suffix}", steps[(v, sp)], c)
  for v in sorted({v for v, _ in steps}):
    if (v, False) in steps and (v, True) in steps:
      _put_ratio(out, f"step_{v}_shared_prefix_speedup", steps[(v, False)], steps[(v, True)])
  for (v, sp), r in sorted(steps.items(), key=str):
    if r.get("mfu") is not None:
      out[f"step_{v}_mfu" + ("" if sp is None else f"_shared_prefix_{'on' if sp else 'off'}")] = r["mfu"]
  for r in records:
    if r["name"] == "rollout/sampler" and "decode_tokens_per_s" in r:
      out["decode_tokens_per_s"] = r["decode_tokens_per_s"]
      out["decode_bandwidth_fraction"] = r.get("decode_bandwidth_fraction")
      if r.get("decode_spec_bandwidth_fraction") is not None:
        out["decode_spec_bandwidth_fraction"] = r["decode_spec_bandwidth_fraction"]
    if r["name"] == "rollout/greedy_uncached" and "cache_speedup" in r:
      out["kv_cache_speedup"] = r["cache_speedup"]
    if r["name"] == "rl" and r.get("step_s"):
      out["rl_step_s"] = r["step_s"]
      out["rl_peak_rss_bytes"] = max(r["peak_rss_bytes"], r["peak_children_rss_bytes"])
      for phase in ("update", "rollout"):
        if r.get(f"{phase}_over_floor") is not None:
          out[f"rl_{phase}_over_floor"] = r[f"{phase}_over_floor"]
    if r["name"] == "reference" and r.get("utilisation") is not None:
      out["reference_pass_utilisation"] = r["utilisation"]
    if r["name"] == "against":
      out["peer"] = r["peer"]
      out.update({f"rl_{k}_over_peer": v for k, v in r["ratios"].items()})
  out["errors"] = sum(("error" in r) + ("memory_error" in r) for r in records)
  out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
  return out

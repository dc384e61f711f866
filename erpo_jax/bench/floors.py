"""Figures derived from a bench record and the device line: utilisation, MFU and the decode floors.

Utilisation is achieved FLOP/s over the measured matmul peak of the record's
compute dtype; the MFU is over the device's data-sheet dense bfloat16 peak
(bench/machine.py); the decode floors are a step's bytes over the read
bandwidth and its FLOPs over the matmul peak.
"""

from __future__ import annotations

from typing import Any

from erpo_jax.bench import machine


def peak_for(rec: dict[str, Any], device: dict[str, Any]) -> tuple[float | None, str]:
  """(matmul FLOP/s of the record's compute dtype, where it was measured).

  The larger of the device line's figure and the one taken in the record's own
  process: on a shared host a sub-second probe can catch a busy moment, and a
  peak is the best the device was seen to do.
  """
  seen = {"device line": device.get(f"peak_flops_per_s_{rec.get('dtype', 'float32')}"),
          "same process, after the timed runs": rec.get("local_peak_flops_per_s")}
  seen = {k: v for k, v in seen.items() if v}
  if not seen:
    return None, "none"
  source = max(seen, key=seen.get)
  return seen[source], source


def with_spec_peaks(device: dict[str, Any], *, peak_flops: float | None = None,
                    peak_bandwidth: float | None = None) -> dict[str, Any]:
  """The device line with the data-sheet peaks of its device_kind (bench/machine.py), or those given.

  spec_flops_per_s: dense bfloat16 matmul FLOP/s; spec_bytes_per_s: memory
  (HBM) bandwidth. None where neither the table nor the options know them (CPUs).
  """
  spec = machine.spec_peaks(device.get("device_kind") or "")
  device["spec_flops_per_s"] = peak_flops or spec.get("bfloat16_flops_per_s")
  device["spec_bytes_per_s"] = peak_bandwidth or spec.get("hbm_bytes_per_s")
  return device


def with_utilisation(rec: dict[str, Any], device: dict[str, Any], rate_key: str, out_key: str) -> None:
  """rec[out_key] = rec[rate_key] / matmul peak of the compute dtype (measured); and the MFU.

  The MFU (out_key with "utilisation" -> "mfu") is over the device's
  data-sheet dense bfloat16 peak, whatever the compute dtype.
  """
  peak, source = peak_for(rec, device)
  rate = rec.get(rate_key)
  if peak and rate is not None:
    rec["peak_flops_per_s"] = peak
    rec["peak_source"] = source
    rec[out_key] = rate / peak
  spec = device.get("spec_flops_per_s")
  if spec and rate is not None:
    rec["spec_flops_per_s"] = spec
    rec[out_key.replace("utilisation", "mfu")] = rate / spec


def with_rl_floors(rec: dict[str, Any], device: dict[str, Any]) -> None:
  """Compute floors of the rl record's update and rollout: their work's FLOPs (update_flops,
  rollout_flops, medians over the timed steps) over the matmul peak, and the measured time over that
  floor (1 = at the floor)."""
  peak, source = peak_for(rec, device)
  if not peak:
    return
  rec["peak_flops_per_s"], rec["peak_source"] = peak, source
  for phase in ("update", "rollout"):
    work, took = rec.get(f"{phase}_flops"), rec.get(f"{phase}_s")
    if work and took:
      rec[f"{phase}_floor_s"] = work / peak
      rec[f"{phase}_over_floor"] = took / (work / peak)


def with_decode_floors(rec: dict[str, Any], device: dict[str, Any]) -> None:
  """Floors of one decode step: bytes it must read / read bandwidth, and its FLOPs / matmul peak.

  bytes = parameter bytes + keys and values of the valid context (mean prompt
  length + M/2); fraction = floor / measured step time (1 = at the floor).
  The bandwidth is the larger of the device line's and the record's own process's.
  """
  bw = max(rec.get("local_read_bytes_per_s") or 0.0, device.get("read_bytes_per_s") or 0.0)
  step_s = rec.get("decode_step_s")
  if not bw or not step_s or step_s <= 0:
    return
  floor_bw = (rec["param_bytes"] + rec["kv_bytes_per_step"]) / bw
  rec["read_bytes_per_s"] = bw
  rec["decode_bandwidth_floor_s"] = floor_bw
  rec["decode_bandwidth_fraction"] = floor_bw / step_s
  peak, _ = peak_for(rec, device)
  if peak:
    floor_c = rec["decode_step_flops"] / peak
    rec["decode_compute_floor_s"] = floor_c
    rec["decode_roofline_fraction"] = max(floor_bw, floor_c) / step_s
  spec_bw = device.get("spec_bytes_per_s")
  if spec_bw:  # the same bytes over the data-sheet bandwidth (HBM)
    floor_spec = (rec["param_bytes"] + rec["kv_bytes_per_step"]) / spec_bw
    rec["spec_bytes_per_s"] = spec_bw
    rec["decode_spec_bandwidth_floor_s"] = floor_spec
    rec["decode_spec_bandwidth_fraction"] = floor_spec / step_s

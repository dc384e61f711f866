"""What a bench ran on: the host CPU's model name and the data-sheet peaks of known accelerators.

Imports no JAX: `bench --against` checks the peer's machine before any device starts.
"""

from __future__ import annotations

import platform


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
  """The CPU's model name ("model name" in /proc/cpuinfo); platform.processor() or the ISA where absent."""
  try:
    with open(cpuinfo, encoding="utf-8", errors="replace") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model") and value.strip():
          return " ".join(value.split())
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown"


# Data-sheet peaks per device_kind prefix (jax.devices()[0].device_kind): dense bfloat16 matmul FLOP/s
# (no sparsity) and HBM bytes/s. MFU is measured FLOP/s over this; the bench's own matmul probe is a
# second, attainable, figure beside it.
SPEC_PEAKS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bfloat16_flops_per_s": 989e12, "hbm_bytes_per_s": 4.8e12},  # SXM
    "NVIDIA H200 NVL": {"bfloat16_flops_per_s": 835e12, "hbm_bytes_per_s": 4.8e12},
    "NVIDIA H100 80GB HBM3": {"bfloat16_flops_per_s": 989e12, "hbm_bytes_per_s": 3.35e12},  # SXM
    "NVIDIA H100 PCIe": {"bfloat16_flops_per_s": 756e12, "hbm_bytes_per_s": 2.0e12},
    "NVIDIA A100-SXM4-80GB": {"bfloat16_flops_per_s": 312e12, "hbm_bytes_per_s": 2.039e12},
    "NVIDIA A100-SXM4-40GB": {"bfloat16_flops_per_s": 312e12, "hbm_bytes_per_s": 1.555e12},
    "TPU v4": {"bfloat16_flops_per_s": 275e12, "hbm_bytes_per_s": 1.2e12},
    "TPU v5 lite": {"bfloat16_flops_per_s": 197e12, "hbm_bytes_per_s": 8.19e11},
    "TPU v5": {"bfloat16_flops_per_s": 459e12, "hbm_bytes_per_s": 2.765e12},  # v5p
    "TPU v6 lite": {"bfloat16_flops_per_s": 918e12, "hbm_bytes_per_s": 1.64e12},  # v6e
}


def spec_peaks(device_kind: str) -> dict[str, float]:
  """The data-sheet peaks of the longest SPEC_PEAKS prefix of `device_kind`; {} when unknown (CPUs)."""
  known = [k for k in SPEC_PEAKS if device_kind.startswith(k)]
  return dict(SPEC_PEAKS[max(known, key=len)]) if known else {}

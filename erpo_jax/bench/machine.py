"""What a bench ran on: the host CPU's model name and vector ISA, the share of its CPU time the hypervisor
gave to other machines, and the data-sheet peaks of known accelerators.

Imports no JAX: `bench --against` checks the peer's machine before any device starts.
"""

from __future__ import annotations

import os
import platform
import shlex
from typing import Any


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


# Widest first: the x86 vector extensions that set XLA's and torch's CPU kernels apart.
VECTOR_ISAS = (("avx512f", "AVX512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4_2"))


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> str | None:
  """The CPU's widest vector ISA ("AVX512", "AVX2", ...) by its /proc/cpuinfo flags, "+BF16" where it has
  bfloat16 dot instructions (avx512_bf16 or amx_bf16); None where there are no x86 flags to read."""
  try:
    with open(cpuinfo, encoding="utf-8", errors="replace") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "flags":
          flags = set(value.split())
          isa = next((name for flag, name in VECTOR_ISAS if flag in flags), "x86")
          return isa + ("+BF16" if flags & {"avx512_bf16", "amx_bf16"} else "")
  except OSError:
    pass
  return None


def xla_max_isa(xla_flags: str | None = None) -> str | None:
  """The ISA XLA's CPU backend is held to by --xla_cpu_max_isa in XLA_FLAGS (the last one given), else None.

  The flag holds the code XLA generates (fusions) but not its matmul library: on an AVX-512 machine the
  products still run at the AVX-512 speed, so a run held to AVX2 does not stand for an AVX2 machine
  (docs/PERFORMANCE.md). Records carry it so that a run made with it says so."""
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  limit = None
  for i, word in enumerate(words := shlex.split(flags)):
    if word.startswith("--xla_cpu_max_isa="):
      limit = word.partition("=")[2]
    elif word == "--xla_cpu_max_isa" and i + 1 < len(words):
      limit = words[i + 1]
  return limit.upper() if limit else None


def isa_family(isa: str | None) -> str | None:
  """"AVX512" for any AVX512* name (XLA's AVX512_BF16, torch's AVX512), else the name without +BF16."""
  if not isa:
    return None
  isa = isa.upper().partition("+")[0]
  return "AVX512" if isa.startswith("AVX512") else isa


def cpu_times(stat: str = "/proc/stat") -> tuple[int, int] | None:
  """(steal, total) clock ticks of all the host's CPUs since boot, from /proc/stat; None where absent."""
  try:
    with open(stat, encoding="ascii") as f:
      fields = f.readline().split()
  except OSError:
    return None
  if len(fields) < 9 or fields[0] != "cpu":
    return None
  ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
  return ticks[7], sum(ticks)


def steal_share(start: tuple[int, int] | None, end: tuple[int, int] | None = None) -> float | None:
  """The share of the CPU time between two `cpu_times` that the hypervisor gave to other machines.

  A host shared with other virtual machines runs slower while they are busy; the load average does not show
  it, so timings carry this beside it (`steal_warning`)."""
  end = cpu_times() if end is None else end
  if start is None or end is None or end[1] <= start[1]:
    return None
  return round((end[0] - start[0]) / (end[1] - start[1]), 4)


# A record whose steal_share is above this gets a warning line on stderr.
STEAL_WARN = 0.05


def steal_warning(rec: dict[str, Any]) -> str | None:
  """The warning line of a record measured while other virtual machines took over STEAL_WARN of the CPU."""
  if (rec.get("steal_share") or 0) <= STEAL_WARN:
    return None
  return (f"warning: bench {rec['name']}: the hypervisor gave {rec['steal_share']:.0%} of the host's CPU time to "
          f"other machines while it ran; its times are slower than this machine's own")


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

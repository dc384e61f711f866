"""The CPU kernels' AVX2 build, made beside the native build on AVX-512 machines, for tests that check both."""

import ctypes

import pytest

from erpo_jax.model import cpu_kernel


def avx2_build(out_dir) -> ctypes.CDLL:
  """The kernel library built without AVX-512 into `out_dir`, loaded. Skips where the CPU cannot run it, and
  where it is the native build (no AVX-512), which every other kernel test runs."""
  with open("/proc/cpuinfo", encoding="utf-8") as f:
    flags = f.read()
  if " avx2" not in flags or " fma" not in flags:
    pytest.skip("this CPU has no AVX2 with FMA")
  if " avx512f" not in flags:
    pytest.skip("this CPU has no AVX-512: its native build, which the other tests run, is the AVX2 build")
  return ctypes.cdll.LoadLibrary(cpu_kernel.build(cpu_kernel.compiler(), str(out_dir), ("-mno-avx512f",)))

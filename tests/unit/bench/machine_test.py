"""The machine a bench ran on: its CPU's vector ISA from /proc/cpuinfo and the ISA XLA_FLAGS holds XLA to."""

import pytest

from erpo_jax.bench import machine


def _cpuinfo(tmp_path, flags: str) -> str:
  path = tmp_path / "cpuinfo"
  path.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu {flags}\n\nprocessor\t: 1\n")
  return str(path)


@pytest.mark.parametrize("flags,isa", [
    ("sse4_2 avx avx2 avx512f avx512_bf16", "AVX512+BF16"),
    ("sse4_2 avx avx2 avx512f", "AVX512"),
    ("sse4_2 avx avx2 fma", "AVX2"),
    ("sse4_2 avx avx2 amx_bf16", "AVX2+BF16"),
    ("sse4_2", "SSE4_2"),
    ("vme de", "x86"),
])
def test_cpu_isa_is_the_widest_vector_extension_in_the_flags(tmp_path, flags, isa):
  assert machine.cpu_isa(_cpuinfo(tmp_path, flags)) == isa


def test_cpu_isa_is_none_without_x86_flags(tmp_path):
  path = tmp_path / "cpuinfo"
  path.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
  assert machine.cpu_isa(str(path)) is None and machine.cpu_isa(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("flags,limit", [
    ("", None),
    ("--xla_force_host_platform_device_count=8", None),
    ("--xla_cpu_max_isa=avx2", "AVX2"),
    ("--xla_cpu_max_isa AVX512_BF16 --xla_force_host_platform_device_count=8", "AVX512_BF16"),
    ("--xla_cpu_max_isa=AVX512 --xla_cpu_max_isa=AVX2", "AVX2"),  # the last one given wins
])
def test_xla_max_isa_reads_the_limit_from_xla_flags(flags, limit):
  assert machine.xla_max_isa(flags) == limit


def test_xla_max_isa_reads_the_environment_by_default(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
  assert machine.xla_max_isa() == "AVX2"
  monkeypatch.delenv("XLA_FLAGS")
  assert machine.xla_max_isa() is None


@pytest.mark.parametrize("isa,family", [("AVX512_BF16", "AVX512"), ("AVX512+BF16", "AVX512"), ("avx2", "AVX2"),
                                        ("AVX2+BF16", "AVX2"), (None, None), ("", None)])
def test_isa_family_groups_the_avx512_variants(isa, family):
  assert machine.isa_family(isa) == family

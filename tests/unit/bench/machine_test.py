"""The machine a bench ran on: its CPU's vector ISA from /proc/cpuinfo, the ISA XLA_FLAGS holds XLA to, and the
CPU time the hypervisor gave to other machines while it measured."""

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


def test_steal_share_is_the_hypervisors_part_of_the_cpu_time_between_two_reads(tmp_path):
  stat = tmp_path / "stat"
  # user nice system idle iowait irq softirq steal guest guest_nice
  stat.write_text("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 50 0 25 400 0 0 0 25 0 0\nintr 1\n")
  before = machine.cpu_times(str(stat))
  stat.write_text("cpu  200 0 100 1500 0 0 0 200 0 0\n")
  after = machine.cpu_times(str(stat))
  assert (before, after) == ((50, 1000), (200, 2000))
  assert machine.steal_share(before, after) == 0.15  # 150 of 1000 ticks
  assert machine.steal_share(None, after) is None and machine.steal_share(after, after) is None
  assert machine.cpu_times(str(tmp_path / "absent")) is None
  stat.write_text("intr 1\n")
  assert machine.cpu_times(str(stat)) is None


def test_a_record_measured_while_other_machines_took_the_cpu_gets_a_warning_line():
  assert machine.steal_warning({"name": "rl", "steal_share": 0.05}) is None
  assert machine.steal_warning({"name": "rl", "steal_share": None}) is None
  assert machine.steal_warning({"name": "rl"}) is None
  assert machine.steal_warning({"name": "rl", "steal_share": 0.32}) == (
      "warning: bench rl: the hypervisor gave 32% of the host's CPU time to other machines while it ran; its times "
      "are slower than this machine's own")

"""`bench --against`: a peer's summary JSON read, erpo-jax's figures divided by it, the machines named."""

import json

import pytest

from erpo_jax import cli
from erpo_jax.bench import peer
from erpo_jax.bench import run as bench_run
from erpo_jax.errors import DataError, PathError

CPU = "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
# As trl_grpo_bench.py writes it (--json-out), cut to what the ratios read plus the machine.
SUMMARY = {"framework": "trl.GRPOTrainer", "device": "cpu", "host": {"cpus": 2, "machine": "x86_64", "cpu_model": CPU},
           "step_wall_s": {"median": 40.0, "min": 39.0, "max": 44.0}, "generate_s": {"median": 24.0},
           "rollout_s": {"median": 27.0}, "ref_logps_fwd_s": {"median": 5.0}, "update_s": {"median": 15.0},
           "peak_rss_mb": 2048.0}
# A bench rl record: 3 GiB peak RSS in the trainer, 0.1 GiB in a verifier worker.
RL = {"name": "rl", "step_s": 20.0, "rollout_s": 6.0, "reward_s": 0.2, "reference_s": 1.0, "update_s": 14.0,
      "peak_rss_bytes": 3 * 2 ** 30, "peak_children_rss_bytes": 2 ** 30 // 10, "platform": "cpu",
      "device_kind": "cpu", "cpu_model": CPU}


def _write(tmp_path, obj, name="trl.json") -> str:
  path = tmp_path / name
  path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
  return str(path)


def test_ratios_divide_erpo_jax_figures_by_the_peers(tmp_path):
  rec = peer.compare(RL, peer.load_peer(_write(tmp_path, {"summary": SUMMARY, "per_step": []})), CPU)
  # step 20 / 40; rollout 6 / generate 24; update (1 + 14) / (5 + 15); RSS 3 GiB / 2048 MiB.
  assert rec["ratios"] == {"step": 0.5, "rollout": 0.25, "update": 0.75, "peak_rss": 1.5}
  assert rec["peer_figures"]["peak_rss_bytes"] == 2 * 2 ** 30 and rec["erpo_jax"]["reference_plus_update_s"] == 15.0
  assert rec["machine"]["erpo_jax"]["cpu_model"] == rec["machine"]["peer"]["cpu_model"] == CPU
  assert rec["warnings"] == []
  (line,) = peer.report(rec)
  assert "erpo-jax / trl.GRPOTrainer: step 0.50x, rollout 0.25x, update 0.75x, peak RSS 1.50x" in line
  assert line.count(CPU) == 2


def test_a_peer_measured_on_another_cpu_or_device_is_one_warning_line_each(tmp_path):
  other = {**SUMMARY, "host": {**SUMMARY["host"], "cpu_model": "AMD EPYC 7B13"}}
  rec = peer.compare({**RL, "platform": "gpu", "device_kind": "NVIDIA H200"},
                     peer.load_peer(_write(tmp_path, other)), CPU)
  lines = peer.report(rec)
  assert len(lines) == 3 and all(line.startswith("warning: ") for line in lines[:2])
  assert "'AMD EPYC 7B13'" in lines[0] and f"'{CPU}'" in lines[0] and "different machines" in lines[0]
  assert "erpo-jax ran on gpu (NVIDIA H200) and the peer on cpu" in lines[1]
  assert rec["ratios"]["step"] == 0.5  # still computed and stored


def test_a_peer_file_without_a_cpu_model_says_the_ratio_assumes_this_machine(tmp_path):
  bare = {k: v for k, v in SUMMARY.items() if k != "host"}
  rec = peer.compare(RL, peer.load_peer(_write(tmp_path, bare)), CPU)
  assert len(rec["warnings"]) == 1 and "does not name the CPU" in rec["warnings"][0] and CPU in rec["warnings"][0]


def test_erpo_jax_held_to_avx2_against_a_peer_on_avx512_kernels_is_a_warning(tmp_path):
  summary = {**SUMMARY, "host": {**SUMMARY["host"], "torch_cpu_capability": "AVX512"}}
  held = {**RL, "cpu_isa": "AVX512+BF16", "xla_max_isa": "AVX2"}
  rec = peer.compare(held, peer.load_peer(_write(tmp_path, summary)), CPU)
  assert rec["warnings"] == ["erpo-jax's CPU code ran as AVX2 and the peer's torch kernels as AVX512: the ratios "
                             "compare different instruction sets"]
  assert (rec["machine"]["erpo_jax"]["isa"], rec["machine"]["peer"]["isa"]) == ("AVX2", "AVX512")
  assert "(cpu, AVX2)" in peer.report(rec)[-1] and "(cpu, AVX512)" in peer.report(rec)[-1]
  # Both held to AVX2 (torch by ATEN_CPU_CAPABILITY=avx2): no warning; XLA's AVX512_BF16 is the AVX512 family.
  both = {**summary, "host": {**summary["host"], "torch_cpu_capability": "AVX2"}}
  assert peer.compare(held, peer.load_peer(_write(tmp_path, both)), CPU)["warnings"] == []
  unheld = {**RL, "cpu_isa": "AVX512+BF16", "xla_max_isa": "AVX512_BF16"}
  assert peer.compare(unheld, peer.load_peer(_write(tmp_path, summary)), CPU)["warnings"] == []


def test_a_peer_on_another_allocator_is_a_warning_and_a_summary_without_one_is_none(tmp_path):
  on_glibc = {**SUMMARY, "host": {**SUMMARY["host"], "allocator": "system"}}
  ours = {**RL, "allocator": "mimalloc"}
  rec = peer.compare(ours, peer.load_peer(_write(tmp_path, on_glibc)), CPU)
  assert rec["warnings"] == ["erpo-jax ran on mimalloc and the peer on the C library's malloc: the ratios include "
                             "the allocators' difference (scripts/peers/README.md runs the peer on mimalloc)"]
  assert (rec["machine"]["erpo_jax"]["allocator"], rec["machine"]["peer"]["allocator"]) == ("mimalloc", "system")
  assert "(cpu, mimalloc)" in peer.report(rec)[-1] and "(cpu, system)" in peer.report(rec)[-1]
  assert rec["ratios"]["step"] == 0.5  # still computed
  on_mimalloc = {**SUMMARY, "host": {**SUMMARY["host"], "allocator": "mimalloc",
                                     "allocator_env": {"MIMALLOC_PURGE_DELAY": "-1"}}}
  rec = peer.compare(ours, peer.load_peer(_write(tmp_path, on_mimalloc)), CPU)
  assert rec["warnings"] == [] and rec["machine"]["peer"]["allocator_env"] == {"MIMALLOC_PURGE_DELAY": "-1"}
  # Summaries written before the harness recorded its allocator: nothing is claimed either way.
  rec = peer.compare(ours, peer.load_peer(_write(tmp_path, SUMMARY)), CPU)
  assert rec["warnings"] == [] and rec["machine"]["peer"]["allocator"] is None


def test_the_printed_log_is_read_from_its_last_summary_line(tmp_path):
  log = ("[step] {...}\nSUMMARY_JSON " + json.dumps({**SUMMARY, "step_wall_s": {"median": 80.0}})
         + "\nSUMMARY_JSON " + json.dumps(SUMMARY) + "\n")
  got = peer.load_peer(_write(tmp_path, log, "trl.log"))
  assert got["figures"]["step_wall_s.median"] == 40.0 and got["framework"] == "trl.GRPOTrainer"


@pytest.mark.parametrize("content,needle", [
    ({"summary": {**SUMMARY, "update_s": {"min": 1.0}}}, "missing key 'update_s.median'"),
    ({k: v for k, v in SUMMARY.items() if k != "peak_rss_mb"}, "missing key 'peak_rss_mb'"),
    ({**SUMMARY, "generate_s": {"median": "fast"}}, "key 'generate_s.median' is 'fast', expected a positive number"),
    ({**SUMMARY, "step_wall_s": {"median": 0}}, "key 'step_wall_s.median' is 0"),
    ("{not json", "not the summary JSON of scripts/peers/trl_grpo_bench.py"),
    ("[1, 2]", "expected a JSON object"),
    ("", "neither a JSON object nor a log with a 'SUMMARY_JSON {...}' line"),
])
def test_a_malformed_peer_file_is_an_error_naming_the_file_and_key(tmp_path, content, needle):
  path = _write(tmp_path, content)
  with pytest.raises(DataError) as e:
    peer.load_peer(path)
  assert str(e.value).startswith(f"--against '{path}': ") and needle in str(e.value), str(e.value)


def test_a_missing_peer_file_is_a_path_error():
  with pytest.raises(PathError, match="--against '/nonexistent/trl.json': No such file"):
    peer.load_peer("/nonexistent/trl.json")


def test_cli_refuses_a_bad_peer_file_in_one_line_before_measuring(tmp_path, capsys):
  path = _write(tmp_path, {"summary": {**SUMMARY, "update_s": {}}})
  assert cli.main(["bench", "rl", "--config", "configs/tiny.yaml", "--against", path]) == 2
  err = capsys.readouterr().err
  assert err == f"erpo-jax bench: error: --against '{path}': missing key 'update_s.median' (expected the summary " \
                "JSON of scripts/peers/trl_grpo_bench.py)\n"


def test_cli_against_needs_the_rl_measurement(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "step", "--config", "configs/tiny.yaml", "--against", "trl.json"])
  assert e.value.code == 2 and "use it with bench rl or bench all, not step" in capsys.readouterr().err


def test_summary_carries_the_peer_ratios_and_out_file_gets_every_line(tmp_path, capsys):
  rec = {"name": "against", **peer.compare(RL, peer.load_peer(_write(tmp_path, SUMMARY)), CPU)}
  s = bench_run.summary([RL, rec])
  assert (s["peer"], s["rl_step_over_peer"], s["rl_update_over_peer"], s["rl_peak_rss_over_peer"]) == (
      "trl.GRPOTrainer", 0.5, 0.75, 1.5)
  out = tmp_path / "bench.jsonl"
  for r in (RL, rec, s):
    bench_run.emit(r, str(out))
  printed = capsys.readouterr().out.splitlines()
  assert out.read_text().splitlines() == printed and json.loads(printed[1])["ratios"]["rollout"] == 0.25


# Two `bench rl --out` files of one sitting: GRPO (a reference forward in every update) and ERPO with the cached
# reference, as the bench writes them (a device record, the rl record, the summary), cut to what is read.
GRPO_RL = {**RL, "kl_on": "response", "reference": "forward", "weights": "none", "policy_kl_every": 5,
           "step_s": 14.0, "rollout_s": 3.4, "reference_s": 0.002, "update_s": 10.6, "peak_rss_bytes": 6 * 10 ** 9,
           "peak_children_rss_bytes": 2 * 10 ** 9, "rollout_flops": 605e9, "update_flops": 1775e9,
           "cpu_isa": "AVX512+BF16", "allocator": "mimalloc"}
ERPO_RL = {**GRPO_RL, "kl_on": "prompt", "reference": "cached", "weights": "static", "step_s": 12.25,
           "rollout_s": 3.5, "update_s": 8.75, "peak_rss_bytes": 6.12 * 10 ** 9, "update_flops": 1428e9}


def _bench_out(tmp_path, rl, name="grpo.jsonl") -> str:
  lines = [{"name": "device", "cpu_model": CPU}, {**GRPO_RL, "step_s": 19.0}, rl,
           {"name": "summary", "errors": 0}]
  return _write(tmp_path, "\n".join(json.dumps(x) for x in lines) + "\n", name)


def test_an_earlier_bench_rl_record_is_a_peer_and_adds_the_work_ratio(tmp_path):
  grpo = peer.load_peer(_bench_out(tmp_path, GRPO_RL))
  # The file's last rl record is the one read.
  assert grpo["figures"]["step_wall_s.median"] == 14.0 and grpo["work_flops"] == 605e9 + 1775e9
  rec = peer.compare(ERPO_RL, grpo, CPU)
  r = rec["ratios"]
  assert r["step"] == pytest.approx(12.25 / 14.0) and r["rollout"] == pytest.approx(3.5 / 3.4)
  assert r["update"] == pytest.approx((0.002 + 8.75) / (0.002 + 10.6))
  assert r["peak_rss"] == pytest.approx(6.12 / 6.0)  # the trainer's RSS, above its verifier's
  assert r["work"] == pytest.approx((605 + 1428) / (605 + 1775))  # 0.854: the step ratio at one time per FLOP
  assert rec["warnings"] == []
  (line,) = peer.report(rec)
  assert ("erpo-jax (kl_on prompt, reference cached, weights static, Policy-KL every 5) / "
          "erpo-jax (kl_on response, reference forward, weights none): step 0.875x, rollout 1.029x, "
          "update 0.826x, peak RSS 1.020x, work 0.854x; this run on " in line)
  assert "the earlier run on " + CPU in line
  s = bench_run.summary([ERPO_RL, {"name": "against", **rec}])
  assert s["rl_work_over_peer"] == pytest.approx(0.8542, abs=1e-4) and s["peer"].startswith("erpo-jax (kl_on resp")


def test_an_earlier_run_on_another_allocator_or_without_flop_counts_still_compares_and_says_so(tmp_path):
  old = {k: v for k, v in GRPO_RL.items() if k != "update_flops"}
  rec = peer.compare(ERPO_RL, peer.load_peer(_bench_out(tmp_path, {**old, "allocator": "system"})), CPU)
  assert rec["ratios"]["work"] is None and rec["ratios"]["step"] == pytest.approx(0.875)
  assert len(rec["warnings"]) == 1 and "erpo-jax ran on mimalloc and the peer on the C library's malloc" in (
      rec["warnings"][0])
  assert "work" not in peer.report(rec)[-1]


@pytest.mark.parametrize("broken, needle", [
    ({"error": "RuntimeError: out of memory", "step_s": None}, "'step_s' is None, expected a positive number "
                                                                 "(its measurement failed: run it again)"),
    ({"update_s": 0.0}, "'update_s' is 0.0, expected a positive number"),
    ({"rollout_s": "fast"}, "'rollout_s' is 'fast'"),
])
def test_a_failed_or_damaged_rl_record_is_one_error_naming_the_file_and_key(tmp_path, broken, needle):
  path = _bench_out(tmp_path, {**GRPO_RL, **broken})
  with pytest.raises(DataError) as e:
    peer.load_peer(path)
  assert str(e.value).startswith(f"--against '{path}': the rl record's ") and needle in str(e.value)


def test_both_sides_say_when_their_mimalloc_kept_freed_memory(tmp_path):
  kept = {**SUMMARY, "host": {**SUMMARY["host"], "allocator": "mimalloc",
                              "allocator_env": {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ALLOW_THP": "0"}}}
  rec = peer.compare({**RL, "allocator": "mimalloc", "freed_memory": "returned"},
                     peer.load_peer(_write(tmp_path, kept)), CPU)
  line = peer.report(rec)[-1]
  assert "(cpu, mimalloc), trl.GRPOTrainer on " in line, line
  assert line.endswith("(cpu, mimalloc, freed memory kept (blocks up to 2 GiB))"), line
  assert (rec["machine"]["erpo_jax"]["freed_memory"], rec["machine"]["peer"]["freed_memory"]) == (
      "returned", "kept (blocks up to 2 GiB)")
  returned = {**SUMMARY, "host": {**SUMMARY["host"], "allocator": "mimalloc", "allocator_env": {}}}
  rec = peer.compare({**RL, "allocator": "mimalloc", "freed_memory": "kept (blocks up to 8 GiB)"},
                     peer.load_peer(_write(tmp_path, returned)), CPU)
  line = peer.report(rec)[-1]
  assert line.count("freed memory kept") == 1 and "erpo-jax on " in line, line
  assert rec["machine"]["peer"]["freed_memory"] is None

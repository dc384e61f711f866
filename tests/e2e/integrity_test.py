"""End-to-end integrity of a run folder: damaged files are found, said in one line, and never trained from.

A copy of a finished 8-step run (checkpoints 2, 4, 6, 8) is damaged and the
same command is run again: it must resume from the newest intact checkpoint,
recompute a damaged reference cache, and end bit-identical to the
uninterrupted run; with no intact checkpoint it stops with one line.
"""

import shutil

import pytest

import tiny_runs
from tiny_runs import STEPS, complete_steps


def _finished_copy(tmp_path):
  run = tmp_path / "run"
  shutil.copytree(tiny_runs.reference_run(), run)
  return run


def _warnings(stderr: str) -> list[str]:
  assert "Traceback" not in stderr, stderr[-3000:]
  return [l for l in stderr.splitlines() if l.startswith("warning: ")]


def test_overwritten_checkpoint_bytes_a_flipped_cache_bit_and_a_binary_metrics_line_resume_bit_identical(tmp_path):
  run = _finished_copy(tmp_path)
  tiny_runs.overwrite_4k(run / "checkpoints" / "8")
  cache = run / "cache" / "reference_cache.npz"
  data = bytearray(cache.read_bytes())
  data[len(data) // 2] ^= 0x01
  cache.write_bytes(bytes(data))
  lines = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
  (run / "metrics.jsonl").write_bytes(b"".join(lines[:3]) + b'{"step": 3.5, "x": "\xff\xfe"}\n' + b"".join(lines[3:]))
  proc = tiny_runs.run_train(run)
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = _warnings(proc.stderr)
  assert len(warnings) == 2, proc.stderr[-3000:]
  assert f"{run}/checkpoints/8" in warnings[0] and "newest intact checkpoint, step 6" in warnings[0], warnings
  assert f"reference cache {cache} is damaged" in warnings[1] and "recomputing" in warnings[1], warnings
  assert "resumed from" in proc.stdout and "at step 6" in proc.stdout
  assert (run / "checkpoints" / "8.damaged").is_dir()
  tiny_runs.assert_same_as_reference(run)


@pytest.mark.slow
@pytest.mark.parametrize("damage", [tiny_runs.truncate, tiny_runs.empty, tiny_runs.no_params], ids=["truncated", "emptied", "params missing"])
def test_an_incomplete_latest_checkpoint_resumes_from_the_previous_one_bit_identical(tmp_path, damage):
  run = _finished_copy(tmp_path)
  damage(run / "checkpoints" / "8")
  proc = tiny_runs.run_train(run)
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = _warnings(proc.stderr)
  assert len(warnings) == 1 and f"{run}/checkpoints/8" in warnings[0] and "step 6" in warnings[0], warnings
  tiny_runs.assert_same_as_reference(run)


def test_no_intact_checkpoint_is_one_error_line_and_nothing_is_trained(tmp_path):
  run = _finished_copy(tmp_path)
  for step in complete_steps(run):
    (tiny_runs.overwrite_4k if step % 4 else tiny_runs.no_params)(run / "checkpoints" / str(step))
  before = tiny_runs.metrics_steps(run)
  proc = tiny_runs.run_train(run)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("erpo-jax train: error: no intact checkpoint in"), lines
  for step in (2, 4, 6, 8):
    assert f"checkpoints/{step}" in lines[0]
  assert tiny_runs.metrics_steps(run) == before == list(range(1, STEPS + 1))
  assert not (run / "run.lock").exists()

"""End-to-end disk faults: a checkpoint that cannot be written stops the run with one line naming the path.

The previous checkpoint stays restorable, and `erpo-jax train` with the same
command resumes from it to the same final state as an uninterrupted run.
"""

import shutil
import subprocess
import sys

import pytest

import tiny_runs
from tiny_runs import Training, complete_steps, torn_writes

FILE_LIMIT = 1 << 20  # bytes: a checkpoint's array file (~6 MB here) cannot be written, logs and metrics can


# Runs the rest of argv with every write past FILE_LIMIT failing with EFBIG, as a full disk fails with ENOSPC.
# SIGXFSZ is ignored (else the kernel kills the writer), and an ignored signal stays ignored across exec.
FULL_DISK = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             f"resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE_LIMIT}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]));"
             " os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _error_line(stderr: str) -> str:
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("erpo-jax train: error: "), lines
  return lines[0]


def _resume_to_the_end(run_dir, resumed_from: int) -> None:
  proc = tiny_runs.run_train(run_dir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"at step {resumed_from}" in proc.stdout
  assert not torn_writes(run_dir)
  tiny_runs.assert_same_as_reference(run_dir)


@pytest.mark.slow
def test_disk_full_during_a_save_stops_with_the_path_and_resumes_from_the_previous_checkpoint(tmp_path):
  tiny_runs.reference_run()
  run_dir = tmp_path / "run"
  # The first half of the run (constant learning rate: the same updates as the 8-step command).
  first = tiny_runs.run_train(run_dir, "train.steps=4")
  assert first.returncode == 0, first.stderr[-3000:]
  assert complete_steps(run_dir) == [2, 4]
  full = subprocess.run([sys.executable, "-c", FULL_DISK, *tiny_runs.train_cmd(run_dir)[1:]], cwd=tiny_runs.REPO,
                        env=tiny_runs.child_env(), capture_output=True, text=True, timeout=tiny_runs.RUN_TIMEOUT_S)
  assert full.returncode == 2, full.stderr[-3000:]
  line = _error_line(full.stderr)
  assert f"{run_dir}/checkpoints" in line and "could not be written" in line
  assert "latest complete checkpoint is step 4" in line, line
  assert complete_steps(run_dir) == [2, 4]
  assert tiny_runs.all_finite(tiny_runs.load_item(run_dir, 4))
  _resume_to_the_end(run_dir, 4)


@pytest.mark.slow
def test_checkpoint_folder_replaced_by_a_file_mid_write_stops_and_the_restored_folder_resumes(tmp_path):
  tiny_runs.reference_run()
  run_dir = tmp_path / "run"
  ckpt_dir, moved = run_dir / "checkpoints", tmp_path / "checkpoints.moved"
  t = Training(run_dir)
  assert t.wait_for(lambda: any(n.startswith("6.") for n in torn_writes(run_dir)), poll_s=0.0005)
  tiny_runs.replace_folder_by_file(ckpt_dir, moved)  # the folder vanishes during the write of step 6
  rc = t.wait()
  assert rc == 2, t.stderr()[-3000:]
  line = _error_line(t.stderr())
  assert str(ckpt_dir) in line, line
  # The user puts the folder back: steps 2 and 4 are intact, the torn write is not taken for a checkpoint.
  ckpt_dir.unlink()
  shutil.move(moved, ckpt_dir)
  assert complete_steps(run_dir)[-1] == 4
  _resume_to_the_end(run_dir, 4)

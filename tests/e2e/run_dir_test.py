"""End-to-end guards of a run folder: one trainer at a time, and a resume only with the config the run has.

A second `erpo-jax train` on a run.dir in use is refused with one line naming
the holder and leaves the folder alone; a resume that changes what the run
computes is refused unless --allow-config-change, and every changed field is
printed in one line either way.
"""

import json
import shutil
import socket
import subprocess
import sys

import pytest

import tiny_runs
from tiny_runs import STEPS, Training

HOLD = ("import sys, time; from erpo_jax.train.run_folder import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); time.sleep(120)")


def _one_error_line(proc) -> str:
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("erpo-jax train: error: "), lines
  return lines[0]


@pytest.fixture
def finished(tmp_path):
  run = tmp_path / "run"
  shutil.copytree(tiny_runs.reference_run(), run)
  return run


def test_a_second_trainer_on_a_locked_run_dir_is_refused_naming_the_holder(finished):
  hashes = tiny_runs.file_hashes(finished)
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(finished)], env=tiny_runs.child_env(),
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    lock = json.loads((finished / "run.lock").read_text())
    proc = tiny_runs.run_train(finished, timeout=120)
    line = _one_error_line(proc)
    assert f"run.dir '{finished}' is in use by another trainer (pid {holder.pid} on host {socket.gethostname()}, " \
           f"since {lock['since']})" in line, line
    assert {k: v for k, v in tiny_runs.file_hashes(finished).items() if k != "run.lock"} == hashes
  finally:
    holder.kill()
    holder.wait()


@pytest.mark.slow
def test_a_resume_that_changes_group_size_is_refused_and_allowed_with_the_flag(finished):
  hashes = tiny_runs.file_hashes(finished)
  proc = tiny_runs.run_train(finished, "rollout.group_size=8", "optim.lr=0.002")
  line = _one_error_line(proc)
  assert "rollout.group_size 4 -> 8, optim.lr 0.001 -> 0.002" in line and "--allow-config-change" in line, line
  assert tiny_runs.file_hashes(finished) == hashes, "the run folder changed"

  proc = subprocess.run([*tiny_runs.train_cmd(finished, "rollout.group_size=8"), "--allow-config-change"],
                        cwd=tiny_runs.REPO, env=tiny_runs.child_env(), capture_output=True, text=True,
                        timeout=tiny_runs.RUN_TIMEOUT_S)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  said = [l for l in proc.stdout.splitlines() if "changed config" in l]
  assert said == [f"resuming run.dir '{finished}' with a changed config: rollout.group_size 4 -> 8"], proc.stdout
  assert "rollout:\n  group_size: 8\n" in (finished / "config.yaml").read_text()


def test_a_resume_with_another_learning_rate_is_taken_and_said(finished):
  proc = tiny_runs.run_train(finished, "optim.lr=0.002")
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  said = [l for l in proc.stdout.splitlines() if "changed config" in l]
  assert said == [f"resuming run.dir '{finished}' with a changed config: optim.lr 0.001 -> 0.002"], proc.stdout
  assert tiny_runs.metrics_steps(finished) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_two_trainers_started_on_one_run_dir_end_as_one_uninterrupted_run(tmp_path):
  tiny_runs.reference_run()
  run, release = tmp_path / "run", tmp_path / "release"
  first = Training(run, hold=(2, release))  # step 2 waits for the release file: the second starts mid-run
  assert first.wait_for(lambda: 1 in tiny_runs.metrics_steps(run)), first.stderr()[-3000:]
  second = tiny_runs.run_train(run, timeout=120)
  release.touch()
  line = _one_error_line(second)
  assert f"pid {first.proc.pid}" in line, line
  assert first.wait() == 0, first.stderr()[-3000:]
  tiny_runs.assert_same_as_reference(run)
  assert not (run / "run.lock").exists()

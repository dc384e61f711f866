"""End-to-end preemption: SIGTERM saves a checkpoint at the current step, exits 0, and the run resumes exactly."""

import os
import signal
import time

import pytest

import tiny_runs
from erpo_jax import allocator
from tiny_runs import STEPS, Training, complete_steps, metrics_steps

GRACE_S = 60.0  # SIGTERM to exit: finish one step (~1 s here) and write one checkpoint, on a loaded machine
NO_PERIODIC = "checkpoint.every=0"  # any checkpoint before the end is the one SIGTERM asked for


def _preempt(run_dir, after_step: int, **kw) -> tuple[Training, float]:
  t = Training(run_dir, NO_PERIODIC, **kw)
  assert t.wait_for(lambda: after_step in metrics_steps(run_dir)), t.stderr()[-3000:]
  t0 = time.monotonic()
  t.proc.send_signal(signal.SIGTERM)
  rc = t.wait(timeout=GRACE_S)
  assert rc == 0, t.stderr()[-3000:]
  return t, time.monotonic() - t0


def test_sigterm_saves_the_current_step_exits_0_and_resumes_bit_identical(tmp_path):
  tiny_runs.reference_run()
  run_dir = tmp_path / "run"
  t, elapsed = _preempt(run_dir, after_step=3)
  assert elapsed < GRACE_S
  logged = metrics_steps(run_dir)
  saved = complete_steps(run_dir)
  # The step in progress when the signal came is finished, logged and saved; nothing after it starts.
  assert len(saved) == 1 and saved[0] == logged[-1] and 3 <= saved[0] < STEPS, (saved, logged)
  assert f"SIGTERM: saved step {saved[0]}" in t.stdout()
  assert "Traceback" not in t.stderr()
  # The signal reached the trainer through the command's re-execution onto mimalloc (same process id).
  assert f"host allocator {'system' if allocator.mimalloc_library() is None else 'mimalloc'}" in t.stdout()
  proc = tiny_runs.run_train(run_dir, NO_PERIODIC)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"at step {saved[0]}" in proc.stdout
  tiny_runs.assert_same_as_reference(run_dir)


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_also_saves_and_resumes_bit_identical(tmp_path):
  # Batch schedulers (SLURM's scancel, a container stop) signal every process of the job, verifier workers too.
  tiny_runs.reference_run()
  run_dir = tmp_path / "run"
  t = Training(run_dir, NO_PERIODIC, start_new_session=True)
  assert t.wait_for(lambda: 2 in metrics_steps(run_dir)), t.stderr()[-3000:]
  os.killpg(t.proc.pid, signal.SIGTERM)
  assert t.wait(timeout=GRACE_S) == 0, t.stderr()[-3000:]
  saved = complete_steps(run_dir)
  assert len(saved) == 1 and saved[0] == metrics_steps(run_dir)[-1]
  proc = tiny_runs.run_train(run_dir, NO_PERIODIC)
  assert proc.returncode == 0, proc.stderr[-3000:]
  tiny_runs.assert_same_as_reference(run_dir)


@pytest.mark.slow
def test_two_preemptions_in_a_row_lose_nothing(tmp_path):
  tiny_runs.reference_run()
  run_dir = tmp_path / "run"
  _preempt(run_dir, after_step=2)
  first = complete_steps(run_dir)[-1]
  # The second invocation's own lines: the first one's are all <= its checkpoint, so any new step is ours.
  t, _ = _preempt(run_dir, after_step=first + 2)
  assert complete_steps(run_dir)[-1] >= first + 2
  assert "Traceback" not in t.stderr()
  proc = tiny_runs.run_train(run_dir, NO_PERIODIC)
  assert proc.returncode == 0, proc.stderr[-3000:]
  tiny_runs.assert_same_as_reference(run_dir)

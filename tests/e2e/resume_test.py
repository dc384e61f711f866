"""End-to-end kill and resume: SIGKILL at any moment loses nothing but the steps since the last checkpoint.

A tiny run of 8 steps (checkpoints every 2) is killed, resumed with the same
command, and must end bit-identical to an uninterrupted run (params, optimizer
state and every deterministic metric), with metrics.jsonl holding each step once.
"""

import random
import signal
import time

import pytest

import tiny_runs
from tiny_runs import STEPS, Training, complete_steps, metrics_steps, torn_writes


def _resume(run_dir) -> int:
  """Runs the same command to the end; returns the step it resumed from (0 = fresh start)."""
  before = complete_steps(run_dir)
  proc = tiny_runs.run_train(run_dir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  start = before[-1] if before else 0
  if start:
    assert f"at step {start}" in proc.stdout, proc.stdout
  return start


def _check_after_kill(run_dir) -> None:
  """What a SIGKILL leaves: only complete checkpoints count, each restorable; torn writes are not among them."""
  steps = complete_steps(run_dir)
  for name in torn_writes(run_dir):
    assert int(name.split(".")[0]) not in steps, f"torn write {name} counted as complete"
  for step in steps:
    assert tiny_runs.all_finite(tiny_runs.load_item(run_dir, step))
  logged = metrics_steps(run_dir)
  assert logged == list(range(1, len(logged) + 1)), logged


def test_sigkill_after_step_5_resumes_bit_identical_with_each_step_logged_once(tmp_path):
  tiny_runs.reference_run()
  run_dir = tmp_path / "run"
  t = Training(run_dir)
  # Checkpoints are written asynchronously: step 4's may still be in flight when
  # line 5 is logged, so wait for both (step 6's save waits for step 4's anyway).
  assert t.wait_for(lambda: 5 in metrics_steps(run_dir) and 4 in complete_steps(run_dir)), t.stderr()[-3000:]
  t.kill()
  assert t.proc.returncode == -signal.SIGKILL
  _check_after_kill(run_dir)
  start = _resume(run_dir)
  assert 4 <= start < STEPS
  tiny_runs.assert_same_as_reference(run_dir)


def _after_new_line(run_dir, resumed_from: int, step: int):
  """A condition: this invocation (resumed at `resumed_from`) has logged `step`.

  Lines a killed invocation wrote past its last checkpoint are still in the file
  until the new one truncates them, so they must be gone first.
  """
  state = {"truncated": False}

  def condition() -> bool:
    steps = metrics_steps(run_dir)
    state["truncated"] = state["truncated"] or max(steps, default=0) <= resumed_from
    return state["truncated"] and step in steps

  return condition


def _kill_during_start_up(t: Training, rng: random.Random, resumed_from: int) -> str:
  del t, resumed_from
  delay = rng.uniform(0.5, 3.0)
  time.sleep(delay)
  return f"{delay:.2f} s after start"


def _kill_after_line(t: Training, rng: random.Random, resumed_from: int) -> str:
  k = rng.randint(resumed_from + 1, min(resumed_from + 3, STEPS - 1))
  assert t.wait_for(_after_new_line(t.run_dir, resumed_from, k))
  return f"right after metrics line {k}"


def _kill_during_rollout(t: Training, rng: random.Random, resumed_from: int) -> str:
  k = rng.randint(resumed_from + 1, min(resumed_from + 3, STEPS - 1))
  assert t.wait_for(_after_new_line(t.run_dir, resumed_from, k))
  delay = rng.uniform(0.01, 0.1)  # a step's rollout takes ~0.15 s here, its update ~0.4 s
  time.sleep(delay)
  return f"{delay:.2f} s after metrics line {k} (step {k + 1}'s rollout)"


def _kill_during_update(t: Training, rng: random.Random, resumed_from: int) -> str:
  k = rng.randint(resumed_from + 1, min(resumed_from + 3, STEPS - 1))
  assert t.wait_for(_after_new_line(t.run_dir, resumed_from, k))
  delay = rng.uniform(0.25, 0.45)
  time.sleep(delay)
  return f"{delay:.2f} s after metrics line {k} (step {k + 1}'s update)"


def _kill_during_checkpoint_write(t: Training, rng: random.Random, resumed_from: int) -> str:
  del rng
  new_tmp = lambda: [n for n in torn_writes(t.run_dir) if int(n.split(".")[0]) > resumed_from]
  assert t.wait_for(lambda: bool(new_tmp()), poll_s=0.0005)
  return f"while writing checkpoint {new_tmp()[0].split('.')[0] if new_tmp() else '?'}"


KILLS = (_kill_during_start_up, _kill_after_line, _kill_during_checkpoint_write, _kill_during_rollout,
         _kill_during_update)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_five_kills_at_seeded_moments_end_bit_identical_to_an_uninterrupted_run(tmp_path, seed):
  tiny_runs.reference_run()
  rng = random.Random(seed)
  run_dir = tmp_path / "run"
  resumed_from, moments = 0, []
  for kill in KILLS:
    t = Training(run_dir)
    moments.append(kill(t, rng, resumed_from))
    t.kill()
    assert t.proc.returncode == -signal.SIGKILL, (moments, t.stderr()[-3000:])
    _check_after_kill(run_dir)
    steps = complete_steps(run_dir)
    resumed_from = steps[-1] if steps else 0
    moments[-1] += f" (logged {metrics_steps(run_dir)[-1:]}, saved {steps}, torn {torn_writes(run_dir)})"
    assert resumed_from < STEPS, moments
  _resume(run_dir)
  tiny_runs.assert_same_as_reference(run_dir)
  print("\n".join(moments))  # shown with pytest -s


@pytest.mark.slow
def test_checkpoint_killed_mid_write_is_never_the_one_resumed_from(tmp_path):
  run_dir = tmp_path / "run"
  t = Training(run_dir)
  assert t.wait_for(lambda: any(n.startswith("4.") for n in torn_writes(run_dir)), poll_s=0.0005)
  t.kill()
  if "4" in [str(s) for s in complete_steps(run_dir)]:
    pytest.skip("checkpoint 4 finished writing before the kill landed")
  assert complete_steps(run_dir) == [2]
  _check_after_kill(run_dir)
  assert _resume(run_dir) == 2
  assert not torn_writes(run_dir)  # the torn folder was removed on resume
  tiny_runs.assert_same_as_reference(run_dir)

"""End-to-end numerical faults: a NaN/Inf loss stops the run naming the step (exit 3) or skips that update.

The faults are real: NaN rewards at one step (tests/fault_train.py, through the
trainer's Hooks, which feeds them through the jitted update), or a learning rate so large
that the parameters overflow. Whatever happens, no checkpoint holds NaN or Inf.
"""

import pytest

import tiny_runs
from tiny_runs import complete_steps, load_item, metrics_rows, metrics_steps

EVERY_STEP = ("checkpoint.every=1",)


def _error_lines(stderr: str) -> list[str]:
  return [l for l in stderr.splitlines() if l.strip()]


def _assert_every_checkpoint_finite(run_dir) -> None:
  for step in complete_steps(run_dir):
    for item in ("params", "opt_state"):
      assert tiny_runs.all_finite(load_item(run_dir, step, item)), f"checkpoint {step} {item} is not finite"


def test_nan_loss_stops_the_run_with_exit_3_naming_the_step_and_saves_nothing_from_it(tmp_path):
  run_dir = tmp_path / "run"
  proc = tiny_runs.run_train(run_dir, *EVERY_STEP, nan_step=3)
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  lines = _error_lines(proc.stderr)
  assert len(lines) == 1 and "non-finite loss at step 3" in lines[0], lines
  assert complete_steps(run_dir) == [1, 2]  # step 2's asynchronous write was completed before exiting
  assert metrics_steps(run_dir) == [1, 2]
  _assert_every_checkpoint_finite(run_dir)


@pytest.mark.slow
def test_skip_nonfinite_skips_exactly_that_update_and_finishes_finite(tmp_path):
  run_dir = tmp_path / "run"
  proc = tiny_runs.run_train(run_dir, *EVERY_STEP, "train.steps=4", "train.skip_nonfinite=true", nan_step=3)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "step 3: non-finite loss or gradients; update skipped" in proc.stdout
  assert complete_steps(run_dir) == [1, 2, 3, 4]
  _assert_every_checkpoint_finite(run_dir)
  for item in ("params", "opt_state"):  # step 3 changed nothing (not even Adam's step count); 4 did update
    tiny_runs.assert_bit_equal(load_item(run_dir, 3, item), load_item(run_dir, 2, item))
    with pytest.raises(AssertionError):
      tiny_runs.assert_bit_equal(load_item(run_dir, 4, item), load_item(run_dir, 3, item))
  rows = {r["step"]: r for r in metrics_rows(run_dir)}
  assert sorted(rows) == [1, 2, 3, 4]
  assert rows[3]["optim/finite"] == 0.0 and rows[3]["loss/total"] != rows[3]["loss/total"]  # NaN
  assert rows[2]["optim/finite"] == rows[4]["optim/finite"] == 1.0


@pytest.mark.slow
def test_run_stopped_by_nan_resumes_from_the_last_finite_checkpoint_bit_identical(tmp_path):
  run_dir = tmp_path / "run"
  assert tiny_runs.run_train(run_dir, nan_step=5).returncode == 3
  assert complete_steps(run_dir) == [2, 4]
  proc = tiny_runs.run_train(run_dir)  # the fault is gone
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "at step 4" in proc.stdout
  tiny_runs.assert_same_as_reference(run_dir)


@pytest.mark.slow
def test_overflowing_learning_rate_stops_with_exit_3_and_no_checkpoint_of_the_overflow(tmp_path):
  run_dir = tmp_path / "run"
  # Adam moves every weight by ~lr in step 1; at 1e30 the next forward overflows to Inf/NaN.
  proc = tiny_runs.run_train(run_dir, *EVERY_STEP, "optim.lr=1e30")
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = _error_lines(proc.stderr)
  assert len(lines) == 1 and "non-finite loss at step 2" in lines[0], lines
  assert complete_steps(run_dir) == [1]
  _assert_every_checkpoint_finite(run_dir)


@pytest.mark.slow
def test_an_update_that_leaves_the_state_non_finite_is_not_saved_and_the_run_says_so(tmp_path):
  run_dir = tmp_path / "run"
  # 1e39 is Inf in float32: step 1's loss and gradients are finite, the weights it leaves are not.
  proc = tiny_runs.run_train(run_dir, *EVERY_STEP, "optim.lr=1e39")
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert "step 1: parameters or optimizer state not finite; no checkpoint written" in proc.stdout
  assert "non-finite loss at step 2" in proc.stderr
  assert complete_steps(run_dir) == []

"""End-to-end numerical faults: a NaN/Inf loss stops the run naming the step (exit 3) or skips that update.

The faults are real: NaN rewards at one step (tests/fault_train.py, through the
trainer's Hooks, which feeds them through the jitted update), or a learning rate so large
that the parameters overflow. Whatever happens, no checkpoint holds NaN or Inf.
"""

import pathlib
import signal

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
  assert _error_lines(proc.stderr) == [], proc.stderr[-3000:]  # the step's NaN scalars are written without warnings
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


# AdamW moves each weight w by about lr * (1 + weight_decay * |w|) in step 1: at lr = 3.4e38, near the float32
# maximum, the weights it leaves overflow to Inf although the loss and gradients of step 1 are finite.
INF_LR = ("optim.lr=3.4e38", "optim.weight_decay=0.5")


@pytest.mark.slow
def test_an_update_that_leaves_the_weights_non_finite_stops_the_run_at_that_step_with_exit_3(tmp_path):
  run_dir = tmp_path / "run"
  proc = tiny_runs.run_train(run_dir, *EVERY_STEP, *INF_LR)
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = _error_lines(proc.stderr)
  assert len(lines) == 1 and "non-finite parameters or optimizer state at step 1" in lines[0], lines
  assert complete_steps(run_dir) == []
  assert metrics_steps(run_dir) == [1]  # the step is logged; no rollout of step 2 is spent on Inf weights


@pytest.mark.slow
def test_skip_nonfinite_stops_at_its_first_skip_when_the_weights_are_already_non_finite(tmp_path):
  # Skipping an update helps a NaN loss; weights already Inf stay Inf, so the run stops at once (exit 3) instead of
  # skipping every later step and ending with exit 0 (or, without periodic checkpoints, only at the final save).
  run_dir = tmp_path / "run"
  proc = tiny_runs.run_train(run_dir, "checkpoint.every=0", *INF_LR, "train.skip_nonfinite=true")
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = _error_lines(proc.stderr)
  assert len(lines) == 1 and "non-finite parameters or optimizer state at step 2" in lines[0], lines
  assert "update skipped" not in proc.stdout
  assert complete_steps(run_dir) == [] and metrics_steps(run_dir) == [1]


@pytest.mark.slow
def test_sigterm_with_non_finite_weights_exits_3_and_does_not_claim_a_save(tmp_path):
  run_dir, release = tmp_path / "run", tmp_path / "release"
  # Step 1 waits after its rollout; SIGTERM comes then, so step 1's update (which leaves Inf weights) ends with the
  # save SIGTERM asks for. No periodic saves: that save is the only one.
  t = tiny_runs.Training(run_dir, "checkpoint.every=0", *INF_LR, hold=(1, release))
  assert t.wait_for(lambda: pathlib.Path(f"{release}.held").exists()), t.stderr()[-3000:]
  t.proc.send_signal(signal.SIGTERM)
  release.touch()
  assert t.wait(timeout=120) == 3, t.stderr()[-3000:]
  assert "SIGTERM: saved" not in t.stdout()
  lines = _error_lines(t.stderr())
  assert len(lines) == 1 and "non-finite parameters or optimizer state at step 1" in lines[0], lines
  assert complete_steps(run_dir) == [] and metrics_steps(run_dir) == [1]

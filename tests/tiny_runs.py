"""Runs `erpo-jax train` on configs/tiny.yaml in a subprocess and reads back what it left on disk.

Shared by the end-to-end reliability tests (resume, preemption, faults). Every
run uses one persistent XLA compilation cache, so only the first run of a test
session pays for compiling the tiny model's programs.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import orbax.checkpoint as ocp


from erpo_jax.train import checkpoint_io as cio
from erpo_jax import metrics

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 8  # the length of every reliability run
BASE = (f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=8")
RUN_TIMEOUT_S = 400  # one tiny run, cold compilation cache, loaded machine


def child_env(**extra: str) -> dict[str, str]:
  """The environment of a training subprocess: ours (with the suite's compilation cache, conftest.py), every
  program written to the cache, and `extra`."""
  env = dict(os.environ)
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  env.update(extra)
  return env


def train_cmd(run_dir, *overrides: str, config: str = TINY, nan_step: int | None = None,
              hold: tuple[int, pathlib.Path] | None = None) -> list[str]:
  """`erpo-jax train` on the tiny config; with nan_step (NaN rewards at that step) or hold = (step, release file:
  that step waits until the file exists), through tests/fault_train.py."""
  entry = ["-m", "erpo_jax.cli"]
  if nan_step is not None:
    entry = [str(REPO / "tests" / "fault_train.py"), "--nan-step", str(nan_step)]
  elif hold is not None:
    entry = [str(REPO / "tests" / "fault_train.py"), "--hold-step", str(hold[0]), "--release", str(hold[1])]
  return [sys.executable, *entry, "train", "--config", config, f"run.dir={run_dir}", *BASE, *overrides]


def run_train(run_dir, *overrides: str, env: dict | None = None, timeout: float = RUN_TIMEOUT_S,
              nan_step: int | None = None, **kw) -> subprocess.CompletedProcess:
  """Runs a training command to completion; returns it with text stdout/stderr."""
  return subprocess.run(train_cmd(run_dir, *overrides, nan_step=nan_step), cwd=REPO, env=env or child_env(),
                        capture_output=True, text=True, timeout=timeout, **kw)


class Training:
  """A training subprocess whose stdout/stderr go to files beside (not inside) the run folder."""

  def __init__(self, run_dir, *overrides: str, env: dict | None = None, hold: tuple[int, pathlib.Path] | None = None,
               **kw):
    self.run_dir = pathlib.Path(run_dir)
    logs = self.run_dir.parent / f"{self.run_dir.name}-logs"
    logs.mkdir(exist_ok=True)
    n = len(list(logs.glob("*.out")))
    self.out_path, self.err_path = logs / f"{n}.out", logs / f"{n}.err"
    with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
      self.proc = subprocess.Popen(train_cmd(run_dir, *overrides, hold=hold), cwd=REPO, env=env or child_env(), stdout=out,
                                   stderr=err, **kw)

  def wait_for(self, condition, timeout: float = RUN_TIMEOUT_S, poll_s: float = 0.002) -> bool:
    """Polls `condition()` until it holds (True) or the process ends first (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if condition():
        return True
      if self.proc.poll() is not None:
        return bool(condition())
      time.sleep(poll_s)
    self.proc.kill()
    raise TimeoutError(f"condition not met within {timeout} s; stderr: {self.stderr()[-2000:]}")

  def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
    try:
      return self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
      raise

  def kill(self) -> None:
    """SIGKILL to the trainer process (as the OOM killer or a lost node would); waits for it to end."""
    self.proc.kill()
    self.proc.wait()

  def stdout(self) -> str:
    return self.out_path.read_text(errors="replace")

  def stderr(self) -> str:
    return self.err_path.read_text(errors="replace")


# ----------------------------------------------------------------------------- what a run leaves


def metrics_rows(run_dir) -> list[dict]:
  path = pathlib.Path(run_dir) / metrics.METRICS_FILE
  return metrics.read_jsonl(path) if path.exists() else []


def metrics_steps(run_dir) -> list[int]:
  return [r["step"] for r in metrics_rows(run_dir)]


def deterministic(row: dict) -> dict:
  """A metrics row without wall-clock timings and host counters (page faults, kernel time), which differ between
  runs of the same computation."""
  return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "host/"))}


def complete_steps(run_dir) -> list[int]:
  """The checkpoint steps the trainer would resume from (complete writes only), read without side effects."""
  return cio.complete_steps(pathlib.Path(run_dir) / cio.CHECKPOINTS_DIR)


def torn_writes(run_dir) -> list[str]:
  d = pathlib.Path(run_dir) / cio.CHECKPOINTS_DIR
  return sorted(p.name for p in d.glob("*.orbax-checkpoint-tmp*")) if d.is_dir() else []


def replace_folder_by_file(folder: pathlib.Path, moved: pathlib.Path) -> None:
  """Moves `folder` to `moved` and puts a file where it was, while a checkpoint write is running.

  The writer's threads recreate missing parent folders as they go, so one
  they made between the move and the file is moved aside too, then retried.
  """
  os.rename(folder, moved)
  for i in range(1000):
    try:
      folder.write_text("not a folder")
      return
    except IsADirectoryError:
      os.rename(folder, moved.with_name(f"{moved.name}.recreated{i}"))
  raise AssertionError(f"the checkpoint writer kept recreating {folder}")


def load_item(run_dir, step: int | str = "latest", item: str = "params"):
  """One item (params, opt_state) of a checkpoint as a tree of numpy arrays."""
  step_dir = cio.find_checkpoint(str(step), run_dir)
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
    tree = c.restore(step_dir / item)
  return jax.tree.map(np.asarray, tree)


def assert_bit_equal(a, b) -> None:
  flat_a, tree_a = jax.tree.flatten(a)
  flat_b, tree_b = jax.tree.flatten(b)
  assert tree_a == tree_b
  for x, y in zip(flat_a, flat_b):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes(), "arrays differ"


def all_finite(tree) -> bool:
  return all(np.isfinite(x).all() for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.inexact))


def file_hashes(folder) -> dict[str, str]:
  """{relative path: sha256} of every file under `folder`."""
  folder = pathlib.Path(folder)
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


@functools.cache
def reference_run() -> pathlib.Path:
  """An uninterrupted run of STEPS steps (made once per test process, shared by every file that needs it)."""
  run_dir = pathlib.Path(tempfile.mkdtemp(prefix="erpo-jax-reference-")) / "run"
  atexit.register(shutil.rmtree, run_dir.parent, ignore_errors=True)
  proc = run_train(run_dir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert metrics_steps(run_dir) == list(range(1, STEPS + 1))
  return run_dir


def assert_same_as_reference(run_dir) -> None:
  """Final params and optimizer state bit-identical to the uninterrupted run; metrics equal step by step."""
  ref = reference_run()
  assert complete_steps(run_dir)[-1] == STEPS
  for item in ("params", "opt_state"):
    assert_bit_equal(load_item(run_dir, STEPS, item), load_item(ref, STEPS, item))
  got, want = metrics_rows(run_dir), metrics_rows(ref)
  assert [r["step"] for r in got] == list(range(1, STEPS + 1)), "each step once, no gap, no duplicate"
  for g, w in zip(got, want):
    assert deterministic(g) == deterministic(w), f"metrics of step {g['step']} differ"


# ----------------------------------------------------------------------------- damaging a checkpoint


def largest_file(folder):
  return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def overwrite_4k(step_dir):
  """4 KiB of random bytes written over the middle of the largest params file of a step folder."""
  f = largest_file(step_dir / "params")
  data = bytearray(f.read_bytes())
  mid = len(data) // 2
  data[mid:mid + 4096] = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
  f.write_bytes(bytes(data))


def truncate(step_dir):
  f = largest_file(step_dir / "params")
  os.truncate(f, f.stat().st_size // 2)


def empty(step_dir):
  for f in step_dir.rglob("*"):
    if f.is_file():
      os.truncate(f, 0)


def no_params(step_dir):
  shutil.rmtree(step_dir / "params")

"""The run folder's guards: one trainer per run.dir (run.lock), and resume only with the config the run has."""

import json
import socket
import subprocess
import sys

import pytest

from erpo_jax.config_io import dump_config, load_config
from erpo_jax.errors import UserError
from erpo_jax.train import run_folder
from erpo_jax.train.run_folder import RunLock, RunLockedError, check_resume_config

import tiny_runs

HOLD = ("import sys, time; from erpo_jax.train.run_folder import RunLock; lock = RunLock(sys.argv[1]); "
        "lock.acquire(); print('locked', flush=True); {after}")


def _holder(run_dir, after: str) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-c", HOLD.format(after=after), str(run_dir)], env=tiny_runs.child_env(),
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_a_held_lock_refuses_a_second_trainer_naming_the_holder(tmp_path):
  proc = _holder(tmp_path, "time.sleep(60)")
  try:
    with pytest.raises(RunLockedError) as e:
      RunLock(tmp_path).acquire()
    assert f"pid {proc.pid} on host {socket.gethostname()}" in str(e.value)
    assert str(tmp_path) in str(e.value)
  finally:
    proc.kill()
    proc.wait()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path):
  proc = _holder(tmp_path, "import os; os._exit(0)")  # exits without releasing: the file stays
  proc.wait()
  assert json.loads((tmp_path / run_folder.LOCK_FILE).read_text())["pid"] == proc.pid
  warnings = []
  with RunLock(tmp_path, warn=warnings.append):
    held = json.loads((tmp_path / run_folder.LOCK_FILE).read_text())
    assert held["pid"] != proc.pid and held["host"] == socket.gethostname()
  assert len(warnings) == 1 and f"pid {proc.pid}" in warnings[0] and "no longer running" in warnings[0]
  assert not (tmp_path / run_folder.LOCK_FILE).exists()  # released


def test_a_released_lock_is_taken_without_a_word_and_twice_in_one_process_is_refused(tmp_path):
  warnings = []
  with RunLock(tmp_path, warn=warnings.append):
    with pytest.raises(RunLockedError, match=r"in use by another trainer \(pid \d+"):
      RunLock(tmp_path).acquire()
  with RunLock(tmp_path, warn=warnings.append):
    pass
  assert warnings == []


def test_a_lock_from_another_host_is_refused_with_how_to_clear_it(tmp_path):
  (tmp_path / run_folder.LOCK_FILE).write_text(json.dumps({"pid": 12, "host": "elsewhere-node-7"}))
  with pytest.raises(RunLockedError, match=r"pid 12 on host elsewhere-node-7.*delete .*run.lock"):
    RunLock(tmp_path).acquire()


def _saved(tmp_path, *overrides):
  cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", *overrides])
  (tmp_path / "config.yaml").write_text(dump_config(cfg))


@pytest.mark.parametrize("override", ["rollout.group_size=8", "data.batch_size=4", "model.seed=1",
                                      "erpo.weights=dynamic", "ppo.eps_high=0.28", "train.seed=3",
                                      "data.source=other.jsonl", "reward.correct=2.0"])
def test_a_change_of_what_the_run_computes_is_refused_unless_allowed(tmp_path, override):
  _saved(tmp_path)
  new = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", override, "optim.lr=0.002"])
  key = override.split("=")[0]
  with pytest.raises(UserError) as e:
    check_resume_config(tmp_path, new)
  line = str(e.value)
  assert key in line and "optim.lr 0.001 -> 0.002" in line and "--allow-config-change" in line
  assert "\n" not in line
  printed = []
  check_resume_config(tmp_path, new, allow=True, warn=printed.append)
  assert len(printed) == 1 and key in printed[0] and "optim.lr 0.001 -> 0.002" in printed[0]


def test_other_changes_are_taken_and_each_is_printed_in_one_line(tmp_path):
  _saved(tmp_path)
  new = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", "optim.lr=0.002", "train.steps=10",
                                          "checkpoint.every=5", "model.remat=false"])
  printed = []
  check_resume_config(tmp_path, new, warn=printed.append)
  assert printed == [f"resuming run.dir '{tmp_path}' with a changed config: model.remat true -> false, "
                     "optim.lr 0.001 -> 0.002, train.steps 4 -> 10, checkpoint.every 2 -> 5"]
  same = []
  check_resume_config(tmp_path, load_config("configs/tiny.yaml", [f"run.dir={tmp_path}"]), warn=same.append)
  moved = tmp_path / "moved"
  moved.mkdir()
  (moved / "config.yaml").write_text((tmp_path / "config.yaml").read_text())
  check_resume_config(moved, load_config("configs/tiny.yaml", [f"run.dir={moved}"]), warn=same.append)
  assert same == []


def test_without_config_yaml_the_checkpoints_config_is_compared(tmp_path):
  saved = dump_config(load_config("configs/tiny.yaml", [f"run.dir={tmp_path}"]))
  with pytest.raises(UserError, match="rollout.group_size 4 -> 8"):
    check_resume_config(tmp_path, load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", "rollout.group_size=8"]),
                        saved_text=saved)


def test_the_run_defining_list_classifies_sections_and_exceptions():
  assert run_folder.run_defining("data.batch_size") and run_folder.run_defining("erpo.alpha")
  assert run_folder.run_defining("model.random_init.hidden_size") and run_folder.run_defining("train.seed")
  for key in ("data.num_workers", "erpo.cache_dir", "erpo.reference", "optim.lr", "train.steps", "model.remat",
              "rollout.min_prompt_bucket", "reward.workers", "reward.timeout_s", "mesh.data", "run.dir"):
    assert not run_folder.run_defining(key), key

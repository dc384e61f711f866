"""The persistent compilation cache: where it is, a second process loading what the first wrote, and a folder
that cannot be written costing one warning line, not the run."""

import json
import os
import subprocess
import sys

import pytest

import tiny_runs
from erpo_jax import compile_cache

# Compiles one program through the CLI's set-up and prints the cache's counts.
PROGRAM = ("import json, jax, jax.numpy as jnp; from erpo_jax import compile_cache; d = compile_cache.setup(); "
           "f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum()); print(float(f(jnp.ones((16, 16))))); "
           "print(json.dumps(compile_cache.stats()))")


def _env(**extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "ERPO_JAX_CACHE", "XDG_CACHE"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(tiny_runs.REPO), **extra)
  return env


def _run(**env) -> tuple[subprocess.CompletedProcess, dict]:
  proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=tiny_runs.REPO, env=_env(**env), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  value, stats = proc.stdout.splitlines()[-2:]
  assert float(value) == pytest.approx(256 * 1.0)  # tanh(16) rounds to 1.0 in float32, 16 x 16 of them
  return proc, json.loads(stats)


def test_the_folder_is_erpo_jax_cache_dir_else_the_xdg_cache_and_off_turns_it_off():
  assert compile_cache.wanted_dir({"ERPO_JAX_CACHE_DIR": "/data/xla"}) == "/data/xla"
  assert compile_cache.wanted_dir({"XDG_CACHE_HOME": "/c"}) == "/c/erpo-jax/xla"
  assert compile_cache.wanted_dir({"ERPO_JAX_CACHE_DIR": "", "XDG_CACHE_HOME": "/c"}) == "/c/erpo-jax/xla"
  assert compile_cache.wanted_dir({}) == os.path.expanduser("~/.cache/erpo-jax/xla")
  for off in ("off", "OFF", "none", "0"):
    assert compile_cache.wanted_dir({"ERPO_JAX_CACHE_DIR": off}) is None


def test_a_second_process_loads_what_the_first_wrote_and_writes_nothing(tmp_path):
  cache = tmp_path / "xla"
  # Every program written (the default skips those that compile in under 0.25 s).
  _, first = _run(ERPO_JAX_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  entries = sorted(os.listdir(cache))
  assert first["dir"] == str(cache) and first["hits"] == 0 and first["written"] == first["requests"] >= 1
  assert len([e for e in entries if e.endswith("-cache")]) == first["written"]
  assert any(e.startswith("jit__lambda") for e in entries)
  _, second = _run(ERPO_JAX_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  assert second["hits"] == second["requests"] == first["requests"] and second["written"] == 0
  assert sorted(os.listdir(cache)) == entries


def test_a_cache_set_for_jax_itself_wins_the_default_goes_under_xdg_cache_home_and_off_sets_up_none(tmp_path):
  _, stats = _run(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax"), ERPO_JAX_CACHE_DIR=str(tmp_path / "ours"),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  assert stats["dir"] == str(tmp_path / "jax") and os.listdir(tmp_path / "jax")
  assert not (tmp_path / "ours").exists()
  _, stats = _run(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  assert stats["dir"] == str(tmp_path / "xdg" / "erpo-jax" / "xla") and stats["written"] >= 1
  _, stats = _run(ERPO_JAX_CACHE_DIR="off", XDG_CACHE_HOME=str(tmp_path / "xdg_off"))
  assert stats["dir"] is None and not (tmp_path / "xdg_off").exists()


def test_an_unwritable_cache_folder_is_one_warning_line_and_the_program_still_runs(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  proc, stats = _run(ERPO_JAX_CACHE_DIR=str(blocker / "xla"))
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert lines == [f"warning: compilation cache '{blocker / 'xla'}' is not writable (Not a directory); running "
                   "without it (set ERPO_JAX_CACHE_DIR=<a folder> or ERPO_JAX_CACHE_DIR=off)"]
  assert stats == {"dir": None, "requests": 0, "hits": 0, "written": 0, "saved_s": 0.0, "compile_s": 0.0}


def test_compile_seconds_grow_when_a_program_is_first_met_and_not_when_it_runs_again():
  import jax
  import jax.numpy as jnp

  f = jax.jit(lambda x: jnp.tanh(x @ x.T + 0.125).sum())  # a program no other test compiles
  before = compile_cache.compile_seconds()
  assert float(f(jnp.ones((8, 8)))) == pytest.approx(64 * float(jnp.tanh(8.125)))
  compiled = compile_cache.compile_seconds()
  f(jnp.ones((8, 8))).block_until_ready()
  assert compiled > before and compile_cache.compile_seconds() == compiled


@pytest.mark.slow
def test_a_relaunched_cli_command_compiles_nothing_new(tmp_path):
  cache = tmp_path / "xla"
  argv = [sys.executable, "-m", "erpo_jax.cli", "sample", "--config", tiny_runs.TINY, "--prompt", "hi",
          "--max-new-tokens", "2"]
  env = _env(ERPO_JAX_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  first = subprocess.run(argv, cwd=tiny_runs.REPO, env=env, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-3000:]
  entries = sorted(os.listdir(cache))
  assert any(e.startswith("jit__prefill_fn") for e in entries) and any(e.startswith("jit__decode_fn")
                                                                        for e in entries)
  second = subprocess.run(argv, cwd=tiny_runs.REPO, env=env, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, second.stderr[-3000:]
  assert sorted(os.listdir(cache)) == entries  # every program of the relaunch was loaded, none compiled anew
  assert second.stdout == first.stdout  # greedy: the same completion

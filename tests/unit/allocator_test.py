"""The host allocator: the `erpo-jax` command runs on mimalloc, and XLA's buffers then cost no page faults."""

import json
import os
import re
import subprocess
import sys

import pytest

from erpo_jax import allocator

# A jitted program whose temporary buffer is ~440 MB (a scan's stacked outputs, as in the update's layer
# scan); the child prints the minor page faults of its second, third and fourth calls and the allocator in use.
PROGRAM = r"""
import json, resource, sys
from erpo_jax import allocator
allocator.reexec_if_needed()
import jax, jax.numpy as jnp

@jax.jit
def f(x):
  def body(c, _):
    y = c * 1.0001
    return y, y
  c, ys = jax.lax.scan(body, x, None, length=30)
  return jnp.sum(ys[::7]) + jnp.sum(c)

x = jnp.ones((2048, 1536))
jax.block_until_ready(f(x))
faults = []
for _ in range(3):
  r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(f(x))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print(json.dumps({"allocator": allocator.in_use(), "faults": faults, "argv": sys.argv[1:],
                  "huge_pages": allocator.huge_pages()}))
"""

PAGES_OF_THE_BUFFER = 30 * 2048 * 1536 * 4 // 4096  # 92,160 pages of 4 KiB


def _environment_without_the_commands_settings() -> dict[str, str]:
  """This process's environment less what the command's re-execution sets, so a child gets its defaults."""
  unset = ("LD_PRELOAD", "ERPO_JAX_ALLOCATOR_REEXEC", allocator.THP_ENV, allocator.HOST_MEMORY_ENV,
           *allocator.KEEP_SETTINGS)
  return {k: v for k, v in os.environ.items() if k not in unset}


def _child(choice: str, *argv: str) -> dict:
  env = _environment_without_the_commands_settings()
  env[allocator.ENV] = choice
  proc = subprocess.run([sys.executable, "-c", PROGRAM, *argv], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


needs_mimalloc = pytest.mark.skipif(allocator.mimalloc_library() is None or not sys.platform.startswith("linux"),
                                    reason="cmeel-mimalloc is installed on Linux x86_64 and aarch64 only")


@needs_mimalloc
def test_a_reexecuted_process_runs_on_mimalloc_and_a_programs_later_calls_take_no_page_faults():
  mi = _child("auto", "--flag", "a b")
  system = _child("system")
  assert mi["allocator"] == "mimalloc" and mi["argv"] == ["--flag", "a b"]  # the same arguments after exec
  assert system["allocator"] == "system"
  if allocator.huge_pages() == "allowed":  # this kernel says, and this process may use them
    assert mi["huge_pages"] == "off" and system["huge_pages"] == "allowed"  # what bench records carry
  # The C library's malloc hands the buffer back and faults it in again on every call; mimalloc reuses it. On a
  # loaded machine a call may allocate its buffer before the previous call's is freed, and take a fresh one
  # once (with huge pages off, that is one fault per 4 KiB page): two of the three calls take none.
  assert min(system["faults"]) > PAGES_OF_THE_BUFFER
  assert sorted(mi["faults"])[1] < PAGES_OF_THE_BUFFER // 100, (mi, system)


def test_system_or_a_preloaded_allocator_or_a_second_start_runs_as_it_is():
  assert allocator.preload_environment({allocator.ENV: "system"}) is None
  assert allocator.preload_environment({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) is None
  assert allocator.preload_environment({"ERPO_JAX_ALLOCATOR_REEXEC": "1"}) is None


@needs_mimalloc
def test_auto_preloads_the_installed_mimalloc_before_an_existing_preload():
  env = allocator.preload_environment({"LD_PRELOAD": "/opt/libfoo.so", "PATH": "/bin"})
  lib = str(allocator.mimalloc_library())
  assert env["LD_PRELOAD"] == f"{lib}:/opt/libfoo.so" and env["PATH"] == "/bin"
  assert env["ERPO_JAX_ALLOCATOR_REEXEC"] == "1" and os.path.isfile(lib)


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
  """`python -c code` started with `env`, checked to exit 0."""
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  return out


def _huge_pages(env: dict) -> str | None:
  """allocator.huge_pages() in a process started with `env`."""
  out = _python("from erpo_jax import allocator; print(allocator.huge_pages())", env).stdout.strip()
  return None if out == "None" else out


@needs_mimalloc
def test_the_reexecuted_process_runs_without_transparent_huge_pages_unless_the_environment_asks_for_them():
  # Huge page faults that compact memory stall the programs that take back what mimalloc handed to the kernel.
  base = _environment_without_the_commands_settings()
  assert allocator.preload_environment(base)["MIMALLOC_ALLOW_THP"] == "0"
  assert allocator.preload_environment({**base, "MIMALLOC_ALLOW_THP": "1"})["MIMALLOC_ALLOW_THP"] == "1"
  if _huge_pages(base) != "allowed":
    pytest.skip("this kernel reports no THP_enabled, or has huge pages off already")
  assert _huge_pages(allocator.preload_environment(base)) == "off"  # mimalloc turned them off for the process
  assert _huge_pages(allocator.preload_environment({**base, "MIMALLOC_ALLOW_THP": "1"})) == "allowed"


def _purge_delay(env: dict) -> int:
  """The purge delay that mimalloc reports (MIMALLOC_VERBOSE) in a process started with `env`."""
  out = _python("pass", {**env, "MIMALLOC_VERBOSE": "1"})
  return int(re.search(r"option 'purge_delay': (-?\d+)", out.stderr).group(1))


@needs_mimalloc
def test_the_reexecution_adds_only_the_preload_and_huge_pages_off_and_mimalloc_hands_memory_back_after_a_second():
  # The module's docstring and the README rely on mimalloc's own purge delay: a second, not 10 ms.
  base = _environment_without_the_commands_settings()
  env = allocator.preload_environment(base)
  assert {k: v for k, v in env.items() if base.get(k) != v} == {
      "LD_PRELOAD": str(allocator.mimalloc_library()), "ERPO_JAX_ALLOCATOR_REEXEC": "1", "MIMALLOC_ALLOW_THP": "0"}
  assert _purge_delay(env) == 1000
  assert _purge_delay(allocator.preload_environment({**base, "MIMALLOC_PURGE_DELAY": "-1"})) == -1  # the user's


def test_mimalloc_asked_for_but_missing_and_a_bad_value_are_errors_naming_the_variable(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
  assert allocator.preload_environment({}) is None  # auto: the C library's malloc
  with pytest.raises(ValueError, match="ERPO_JAX_ALLOCATOR=mimalloc: .*pip install cmeel-mimalloc"):
    allocator.preload_environment({allocator.ENV: "mimalloc"})
  with pytest.raises(ValueError, match="ERPO_JAX_ALLOCATOR='jemalloc': expected one of auto, mimalloc, system"):
    allocator.preload_environment({allocator.ENV: "jemalloc"})
  monkeypatch.setattr(allocator.sys, "platform", "darwin")
  assert allocator.preload_environment({}) is None
  with pytest.raises(ValueError, match="ERPO_JAX_ALLOCATOR=mimalloc: preloading is for Linux only"):
    allocator.preload_environment({allocator.ENV: "mimalloc"})


@pytest.mark.parametrize("variable, value, expected", [
    (allocator.ENV, "fast", "ERPO_JAX_ALLOCATOR='fast': expected one of auto, mimalloc, system"),
    (allocator.HOST_MEMORY_ENV, "always", "ERPO_JAX_HOST_MEMORY='always': expected one of return, keep")])
def test_a_bad_allocator_choice_is_one_line_and_exit_code_2_from_the_command(variable, value, expected):
  env = {**os.environ, variable: value}
  proc = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "train", "--help"], env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines() == [f"erpo-jax: error: {expected}"]


# 40 freed host copies of 25 MB with small live allocations between them, as a checkpoint's write leaves them;
# the child prints its RSS with them held, freed, and after release_free_memory.
RETAINED = r"""
import json
from erpo_jax import allocator
allocator.reexec_if_needed()
import numpy as np

def rss():
  return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

keep, copies = [], []
for _ in range(40):
  copies.append(np.ones(25 * 2**20 // 4, np.float32))
  keep.append(np.ones(1000, np.float32))
held = rss()
del copies
freed = rss()
released = allocator.release_free_memory()
print(json.dumps({"allocator": allocator.in_use(), "held": held, "freed": freed, "after": rss(),
                  "released": released}))
"""


def _retained(choice: str) -> dict:
  env = _environment_without_the_commands_settings()
  env[allocator.ENV] = choice
  proc = subprocess.run([sys.executable, "-c", RETAINED], env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_mimalloc
def test_memory_mimalloc_keeps_after_frees_is_handed_back_on_release():
  mi = _retained("auto")
  assert mi["allocator"] == "mimalloc" and mi["released"] == "mimalloc"
  gb = 2**30
  assert mi["freed"] > mi["held"] - 0.1 * gb, mi  # kept mapped after the frees
  assert mi["after"] < mi["held"] - 0.9 * gb, mi  # 1 GB handed back
  system = _retained("system")
  assert system["released"] == "none" and system["freed"] < system["held"] - 0.9 * gb, system


def _mimalloc_options(env: dict) -> dict[str, str]:
  """The options mimalloc reports (MIMALLOC_VERBOSE) in a process started with `env`."""
  out = _python("pass", {**env, "MIMALLOC_VERBOSE": "1"})
  return dict(re.findall(r"option '(\w+)': (-?\d+)", out.stderr))


def test_keeping_freed_memory_is_rejected_in_one_line_where_erpo_jax_cannot_restart_on_mimalloc(monkeypatch):
  keep = {allocator.HOST_MEMORY_ENV: "keep"}
  with pytest.raises(ValueError, match="ERPO_JAX_HOST_MEMORY='forever': expected one of return, keep"):
    allocator.preload_environment({allocator.HOST_MEMORY_ENV: "forever"})
  with pytest.raises(ValueError, match=r"ERPO_JAX_HOST_MEMORY=keep needs erpo-jax to restart on mimalloc, but "
                                       r"ERPO_JAX_ALLOCATOR=system asks for the C library's malloc; set "
                                       r"ERPO_JAX_HOST_MEMORY=return \(with a mimalloc you preload yourself, "
                                       r"MIMALLOC_PURGE_DELAY=-1 MIMALLOC_ARENA_RESERVE=4GiB "
                                       r"MIMALLOC_ARENA_MAX_OBJECT_SIZE=8GiB do the same\)$"):
    allocator.preload_environment({**keep, allocator.ENV: "system"})
  with pytest.raises(ValueError, match=r"but LD_PRELOAD already holds an allocator \(/opt/libjemalloc.so\)"):
    allocator.preload_environment({**keep, "LD_PRELOAD": "/opt/libjemalloc.so"})
  assert allocator.preload_environment({**keep, "ERPO_JAX_ALLOCATOR_REEXEC": "1"}) is None  # the restarted process
  monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
  with pytest.raises(ValueError, match="but the mimalloc library is not installed"):
    allocator.preload_environment(keep)


@needs_mimalloc
def test_keeping_freed_memory_turns_purging_off_in_arenas_that_hold_blocks_up_to_8_gib_unless_the_user_sets_them():
  base = _environment_without_the_commands_settings()
  keep = {**base, allocator.HOST_MEMORY_ENV: "keep"}
  env = allocator.preload_environment(keep)
  assert {k: v for k, v in env.items() if keep.get(k) != v} == {
      "LD_PRELOAD": str(allocator.mimalloc_library()), "ERPO_JAX_ALLOCATOR_REEXEC": "1", "MIMALLOC_ALLOW_THP": "0",
      "MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ARENA_RESERVE": "4GiB", "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "8GiB"}
  options = _mimalloc_options(env)
  assert (options["purge_delay"], options["arena_reserve"], options["arena_max_object_size"]) == (
      "-1", str(4 * 2**20), str(8 * 2**20))  # KiB
  default = _mimalloc_options(allocator.preload_environment(base))
  assert (default["purge_delay"], default["arena_max_object_size"]) == ("1000", str(2 * 2**20))
  own = allocator.preload_environment({**keep, "MIMALLOC_PURGE_DELAY": "5000"})
  assert own["MIMALLOC_PURGE_DELAY"] == "5000" and own["MIMALLOC_ARENA_RESERVE"] == "4GiB"


# A 2.25 GiB block, above mimalloc's default arena_max_object_size (2 GiB), allocated, filled and freed three
# times, as XLA does with the update's temporary buffer; the child prints the page faults of each round.
LARGE_BLOCK = r"""
import json, resource
from erpo_jax import allocator
allocator.reexec_if_needed()
import numpy as np
faults = []
for _ in range(3):
  r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  block = np.ones(9 * 2**28 // 4, np.float32)
  del block
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
print(json.dumps({"faults": faults, "freed_memory": allocator.freed_memory()}))
"""


@needs_mimalloc
def test_a_block_above_2_gib_is_faulted_in_on_every_use_unless_freed_memory_is_kept():
  pages = 9 * 2**28 // 4096  # 589,824
  out = {}
  for choice in ("return", "keep"):
    env = _environment_without_the_commands_settings()
    env[allocator.HOST_MEMORY_ENV] = choice
    proc = subprocess.run([sys.executable, "-c", LARGE_BLOCK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[choice] = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["return"]["freed_memory"] == "returned" and out["keep"]["freed_memory"] == "kept (blocks up to 8 GiB)"
  assert all(f > 0.9 * pages for f in out["return"]["faults"]), out  # mapped anew and unmapped on every free
  assert out["keep"]["faults"][0] > 0.9 * pages, out
  assert all(f < 0.02 * pages for f in out["keep"]["faults"][1:]), out  # the same pages, reused


SIZES = ["8GiB", "3g", "4194304", "1024K", "2MB", "1025", " 7G", "lots", "1.5G", "7GiBx", "-5", "0"]


@needs_mimalloc
def test_freed_memory_names_the_largest_block_mimalloc_keeps_as_mimalloc_itself_reads_the_setting():
  """Purging off, mimalloc keeps freed blocks up to its arena_max_object_size and unmaps larger ones on free:
  the report gives that size, read as MIMALLOC_VERBOSE says mimalloc read it (a value it rejects leaves 2 GiB)."""
  for value in [None, *SIZES]:
    env = {**_environment_without_the_commands_settings(), "LD_PRELOAD": str(allocator.mimalloc_library()),
           "MIMALLOC_VERBOSE": "1", "MIMALLOC_PURGE_DELAY": "-1"}
    if value is not None:
      env["MIMALLOC_ARENA_MAX_OBJECT_SIZE"] = value
    proc = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
    kib = int(re.search(r"option 'arena_max_object_size': (\d+) KiB", proc.stderr).group(1))
    shown = f"{kib >> 20} GiB" if kib % 2**20 == 0 else f"{kib >> 10} MiB" if kib % 2**10 == 0 else f"{kib} KiB"
    assert allocator.freed_memory(env, "mimalloc") == f"kept (blocks up to {shown})", (value, kib)


def test_freed_memory_is_returned_unless_mimalloc_runs_with_purging_off():
  assert allocator.freed_memory({"MIMALLOC_PURGE_DELAY": "-1"}, "mimalloc") == "kept (blocks up to 2 GiB)"
  assert allocator.freed_memory(dict(allocator.KEEP_SETTINGS), "mimalloc") == "kept (blocks up to 8 GiB)"
  for environ, alloc in [({"MIMALLOC_PURGE_DELAY": "-1"}, "system"), ({"MIMALLOC_PURGE_DELAY": "1000"}, "mimalloc"),
                         ({"MIMALLOC_PURGE_DELAY": "abc"}, "mimalloc"), ({}, "mimalloc")]:
    assert allocator.freed_memory(environ, alloc) == "returned"

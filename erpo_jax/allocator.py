"""The host memory allocator of an erpo-jax process: mimalloc where it is installed, else the C library's.

XLA's CPU runtime allocates each program's temporary buffer anew on every
call: gigabytes for a training update. glibc's malloc serves allocations that
large with fresh pages from the kernel and hands them back on free, so every
call takes one page fault per 4 KiB page it first touches (about 600,000 for
the reference workload's update, a second or more of its time). mimalloc keeps
freed memory mapped and reuses it: after the first call, none. On an
accelerator the large buffers live in device memory and this changes little.

A shared library can only replace malloc from the process's start, so the
`erpo-jax` command re-executes itself once, first thing, with mimalloc in
LD_PRELOAD (`exec`: the same process id, arguments, standard streams and
environment otherwise). Child processes (verifier workers, data workers)
inherit it. `ERPO_JAX_ALLOCATOR` chooses:

  auto      mimalloc when the `cmeel-mimalloc` package is installed (a dependency on Linux x86_64 and
            aarch64), else the C library's malloc (the default)
  mimalloc  mimalloc, or exit code 2 with one line saying what to install
  system    the C library's malloc, no re-execution

mimalloc hands memory it has kept free back to the kernel about a second after a free (its own default,
MIMALLOC_PURGE_DELAY=1000 in mimalloc 3.4), so a program that runs after another (the training loop runs the
sampler, the update and the Policy-KL pass in turn) takes its buffers back through page faults. mimalloc also
asks for transparent huge pages, and a huge page fault that has to compact memory first can stall: on a 2-core
Intel Xeon virtual machine, first touching 1 GiB took 0.14-2.6 s with huge pages and 0.33-0.42 s without. The
re-executed process therefore runs with MIMALLOC_ALLOW_THP=0 (mimalloc then turns huge pages off for the whole
process) unless the environment already sets it: the reference workload's RL step there went from 18.1-19.8 s
to 16.1-17.5 s at the same peak RSS. Keeping freed memory for longer than a training step's phases
(MIMALLOC_PURGE_DELAY=3600000) costs gigabytes of RSS and made the step faster in some hours there (14.2-14.5
against 17.5-18.8 s) but not in another (17.4 s both); the environment is passed on, so a user's MIMALLOC_*
settings apply.

`ERPO_JAX_HOST_MEMORY` chooses what mimalloc does with freed memory:

  return    hand it back after mimalloc's delay (the default)
  keep      keep it: purging off, in arenas of 4 GiB that also serve blocks up to 8 GiB (above 2 GiB mimalloc
            otherwise maps each block from the kernel and unmaps it on free), so the update's temporary
            buffer is reused at one address. On a 2-core Intel Xeon with AMX: page faults of the reference
            workload's GRPO step 27-31 thousand against 0.77 million, its step 0.89-0.97x, peak RSS 6.7-6.8 GB
            against 5.9-6.3 GB. Purging off without those arenas kept 13.9 GB. It needs the re-execution with
            mimalloc; MIMALLOC_* settings the environment gives win.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import pathlib
import re
import resource
import sys

ENV = "ERPO_JAX_ALLOCATOR"
CHOICES = ("auto", "mimalloc", "system")
_REEXECUTED = "ERPO_JAX_ALLOCATOR_REEXEC"  # set in the re-executed process: never exec twice
THP_ENV = "MIMALLOC_ALLOW_THP"  # 0 (set on re-execution unless given): no transparent huge pages
HOST_MEMORY_ENV = "ERPO_JAX_HOST_MEMORY"
HOST_MEMORY_CHOICES = ("return", "keep")
KEEP_SETTINGS = {"MIMALLOC_PURGE_DELAY": "-1", "MIMALLOC_ARENA_RESERVE": "4GiB",
                 "MIMALLOC_ARENA_MAX_OBJECT_SIZE": "8GiB"}
# Allocators that keep freed memory mapped: one already preloaded (by the user or a launcher) is kept.
_KNOWN = ("mimalloc", "tcmalloc", "jemalloc")


def mimalloc_library() -> pathlib.Path | None:
  """The shared library that the `cmeel-mimalloc` distribution installs, or None."""
  try:
    files = importlib.metadata.files("cmeel-mimalloc") or []
    dist = importlib.metadata.distribution("cmeel-mimalloc")
  except importlib.metadata.PackageNotFoundError:
    return None
  libs = sorted((f for f in files if f.name.startswith("libmimalloc.so")), key=lambda f: len(f.name))
  for f in libs:
    path = pathlib.Path(dist.locate_file(f))
    if path.is_file():
      return path.resolve()
  return None


def in_use() -> str:
  """The allocator this process runs on: 'mimalloc', 'tcmalloc', 'jemalloc' (mapped into the process), or
  'system'."""
  try:
    maps = pathlib.Path("/proc/self/maps").read_text()
  except OSError:
    return "system"
  for name in _KNOWN:
    if f"lib{name}" in maps:
      return name
  return "system"


def huge_pages() -> str | None:
  """'off' when transparent huge pages are turned off for this process (as mimalloc does with
  MIMALLOC_ALLOW_THP=0), 'allowed' otherwise (the system's setting then decides), None where the kernel does
  not say (no THP_enabled line in /proc/self/status)."""
  try:
    status = pathlib.Path("/proc/self/status").read_text()
  except OSError:
    return None
  m = re.search(r"^THP_enabled:\s*(\d)", status, re.M)
  return None if m is None else ("allowed" if m.group(1) == "1" else "off")


def process_usage() -> tuple[int, float]:
  """(minor page faults, system CPU seconds) of this process so far, all its threads. The difference over a
  training step is what taking memory back from the kernel cost it: the faults of pages touched for the first
  time since the allocator handed them back, and the kernel's time zeroing and mapping them."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return int(r.ru_minflt), float(r.ru_stime)


def choice(environ=os.environ) -> str:
  """ERPO_JAX_ALLOCATOR, checked: one of CHOICES (empty = auto)."""
  value = environ.get(ENV, "").strip().lower() or "auto"
  if value not in CHOICES:
    raise ValueError(f"{ENV}={environ.get(ENV)!r}: expected one of {', '.join(CHOICES)}")
  return value


def host_memory(environ=os.environ) -> str:
  """ERPO_JAX_HOST_MEMORY, checked: one of HOST_MEMORY_CHOICES (empty = return)."""
  value = environ.get(HOST_MEMORY_ENV, "").strip().lower() or "return"
  if value not in HOST_MEMORY_CHOICES:
    raise ValueError(f"{HOST_MEMORY_ENV}={environ.get(HOST_MEMORY_ENV)!r}: expected one of "
                     f"{', '.join(HOST_MEMORY_CHOICES)}")
  return value


def freed_memory(environ=os.environ, allocator: str | None = None) -> str:
  """'kept (blocks up to <size>)' when a process on `allocator` (this one's: `in_use()`) with `environ` runs on
  mimalloc with purging off (ERPO_JAX_HOST_MEMORY=keep, or its own MIMALLOC_PURGE_DELAY): mimalloc keeps freed
  blocks up to its arena_max_object_size and unmaps larger ones on free. 'returned' otherwise: to the kernel after
  mimalloc's delay, or on free."""
  try:
    delay = int(environ.get("MIMALLOC_PURGE_DELAY", "0"))
  except (TypeError, ValueError):
    delay = 0
  if (allocator or in_use()) != "mimalloc" or delay >= 0:
    return "returned"
  kib = _mimalloc_kib(environ.get("MIMALLOC_ARENA_MAX_OBJECT_SIZE"))
  kib = _ARENA_MAX_OBJECT_KIB if kib is None else kib
  shown = f"{kib >> 20} GiB" if kib % 2**20 == 0 else f"{kib >> 10} MiB" if kib % 2**10 == 0 else f"{kib} KiB"
  return f"kept (blocks up to {shown})"


_ARENA_MAX_OBJECT_KIB = 2**21  # mimalloc's arena_max_object_size on 64-bit unless set: 2 GiB
_MIMALLOC_SIZE = re.compile(r"\s*([+-]?\d+)?([KMGT])?(IB|B)?")


def _mimalloc_kib(value: str | None) -> int | None:
  """A mimalloc size setting in KiB as mimalloc reads it (bytes without a suffix, rounded up; K, M, G, T with an
  optional B or iB, any case), or None where it keeps its default (unset, or a value it rejects)."""
  if value is None:
    return None
  m = _MIMALLOC_SIZE.fullmatch(value.upper() or "1")  # an empty value reads as 1
  if not m:
    return None
  number, unit = max(int(m.group(1) or 0), 0), m.group(2)
  return -(-number // 1024) if unit is None else number << {"K": 0, "M": 10, "G": 20, "T": 30}[unit]


def _runs_as_it_is(keep: bool, why: str) -> None:
  """None (no re-execution) for `why`, or ValueError when ERPO_JAX_HOST_MEMORY=keep needed it."""
  if keep:
    raise ValueError(f"{HOST_MEMORY_ENV}=keep needs erpo-jax to restart on mimalloc, but {why}; set "
                     f"{HOST_MEMORY_ENV}=return (with a mimalloc you preload yourself, "
                     + " ".join(f"{k}={v}" for k, v in KEEP_SETTINGS.items()) + " do the same)")


def preload_environment(environ=os.environ) -> dict[str, str] | None:
  """The environment to re-execute this process with, or None to run as it is.

  None on a platform other than Linux, with ERPO_JAX_ALLOCATOR=system, after a re-execution, when a known
  allocator is already preloaded, or (auto) when mimalloc is not installed. Raises ValueError for a bad
  ERPO_JAX_ALLOCATOR or ERPO_JAX_HOST_MEMORY, for `mimalloc` when it is not installed, and for
  ERPO_JAX_HOST_MEMORY=keep where there is no re-execution to give it.
  """
  want = choice(environ)
  keep = host_memory(environ) == "keep"
  if environ.get(_REEXECUTED):
    return None
  if want == "system":
    return _runs_as_it_is(keep, f"{ENV}=system asks for the C library's malloc")
  if not sys.platform.startswith("linux"):
    if want == "mimalloc":
      raise ValueError(f"{ENV}=mimalloc: preloading is for Linux only; set {ENV}=auto or system")
    return _runs_as_it_is(keep, "preloading is for Linux only")
  preload = environ.get("LD_PRELOAD", "")
  if any(f"lib{name}" in preload for name in _KNOWN):
    return _runs_as_it_is(keep, f"LD_PRELOAD already holds an allocator ({preload})")
  lib = mimalloc_library()
  if lib is None:
    if want == "mimalloc":
      raise ValueError(f"{ENV}=mimalloc: the mimalloc library is not installed; install it with "
                       f"`python -m pip install cmeel-mimalloc` or set {ENV}=auto or system")
    return _runs_as_it_is(keep, "the mimalloc library is not installed (`python -m pip install cmeel-mimalloc`)")
  env = dict(environ)
  env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
  env[_REEXECUTED] = "1"
  env.setdefault(THP_ENV, "0")
  if keep:
    for k, v in KEEP_SETTINGS.items():
      env.setdefault(k, v)
  return env


def reexec_if_needed() -> None:
  """Replaces this process by itself with mimalloc preloaded, when `preload_environment` says so.

  Called first thing by the `erpo-jax` command, before JAX is imported. A bad ERPO_JAX_ALLOCATOR or
  ERPO_JAX_HOST_MEMORY is one line on stderr and exit code 2.
  """
  try:
    env = preload_environment()
  except ValueError as e:
    print(f"erpo-jax: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  if env is None:
    return
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
  except OSError as e:  # the interpreter could not be started again: run on as we are
    print(f"erpo-jax: warning: could not restart with mimalloc ({e}); using the C library's malloc",
          file=sys.stderr)


def release_free_memory() -> str:
  """Hands back to the system the freed memory that mimalloc keeps mapped for reuse; returns 'mimalloc', or
  'none' where no allocator of this process keeps any (the C library's gives large blocks back on free).

  A checkpoint's host copies (the parameters and optimizer state, in pieces of many sizes) stay mapped after
  the write has freed them, and the next update's buffers do not reuse most of them: on the default run 0.5 GB
  of its peak RSS. mi_collect(force) takes 15-45 ms there.
  """
  try:
    collect = getattr(ctypes.CDLL(None), "mi_collect", None)  # the process's own symbols: a preloaded mimalloc's
  except (OSError, TypeError):  # no dlopen(NULL) on this platform
    collect = None
  if collect is None:
    return "none"
  collect(ctypes.c_bool(True))
  return "mimalloc"

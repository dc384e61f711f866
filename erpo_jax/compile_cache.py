"""The persistent XLA compilation cache: a relaunched run loads its compiled programs instead of compiling them.

Where: $ERPO_JAX_CACHE_DIR, else $XDG_CACHE_HOME/erpo-jax/xla (~/.cache/erpo-jax/xla).
Off: ERPO_JAX_CACHE_DIR=off. A cache set for JAX itself (JAX_COMPILATION_CACHE_DIR, or
jax.config's jax_compilation_cache_dir) is used as it is. Entries are keyed by the program,
the JAX/XLA version and the device, so a stale entry is never loaded; deleting the folder
(or any file in it) is always safe.
"""

from __future__ import annotations

import os
import sys
import threading

ENV = "ERPO_JAX_CACHE_DIR"
OFF = ("off", "none", "0", "false", "no")
# Programs that compile faster than this are not written: eager ops and small helpers would cost a
# file each for little gain. The train step, prefill and decode loops take seconds to compile.
MIN_COMPILE_TIME_S = 0.25
JAX_DEFAULT_MIN_COMPILE_TIME_S = 1.0

_lock = threading.Lock()
_counts = {"requests": 0, "hits": 0, "written": 0, "saved_s": 0.0, "compile_s": 0.0}
# JAX's event around each program's XLA compilation, or its load from the cache (not tracing or lowering).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_listening = False
_dir: str | None = None


def default_dir(environ=os.environ) -> str:
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "erpo-jax", "xla")


def wanted_dir(environ=os.environ) -> str | None:
  """The folder erpo-jax would set up from the environment: None when ERPO_JAX_CACHE_DIR is off."""
  value = environ.get(ENV, "").strip()
  if value.lower() in OFF:
    return None
  return os.path.expanduser(value) if value else default_dir(environ)


def _writable(path: str) -> str | None:
  """None when `path` is (or can be made) a folder we can write; else why not."""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    with open(probe, "w", encoding="utf-8") as f:
      f.write("ok")
    os.unlink(probe)
  except OSError as e:
    return e.strerror or str(e)
  return None


def setup() -> str | None:
  """Points JAX's persistent compilation cache at its folder; call before anything compiles.

  Returns the folder in use, or None (off, or not writable: one warning line
  on stderr and the run goes on compiling as before).
  """
  global _dir
  import jax  # only here: the CLI reports config mistakes before JAX is imported

  user_dir = jax.config.jax_compilation_cache_dir  # JAX_COMPILATION_CACHE_DIR, or the user's jax.config
  if user_dir:
    _dir = user_dir
  else:
    path = wanted_dir()
    if path is None:
      return None
    why = _writable(path)
    if why is not None:
      # print, not multihost.warn: that starts JAX's backends, before a multi-host job has met.
      print(f"warning: compilation cache '{path}' is not writable ({why}); running without it "
            f"(set {ENV}=<a folder> or {ENV}=off)", file=sys.stderr, flush=True)
      return None
    jax.config.update("jax_compilation_cache_dir", path)
    _dir = path
  if ("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
      and jax.config.jax_persistent_cache_min_compile_time_secs == JAX_DEFAULT_MIN_COMPILE_TIME_S):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  _listen()
  return _dir


def _listen() -> None:
  """Counts the cache's lookups, hits and written entries and the compiling time (JAX's monitoring events) from
  now on."""
  global _listening
  if _listening:
    return
  from jax import monitoring  # importing jax here keeps `import erpo_jax.compile_cache` light for the CLI

  names = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
           "/jax/compilation_cache/cache_hits": "hits",
           "/jax/compilation_cache/cache_misses": "written"}  # JAX records a "miss" when it writes the entry

  def on_event(event: str, **kwargs) -> None:
    if event in names:
      with _lock:
        _counts[names[event]] += 1

  def on_duration(event: str, duration: float, **kwargs) -> None:
    key = {"/jax/compilation_cache/compile_time_saved_sec": "saved_s", BACKEND_COMPILE_EVENT: "compile_s"}.get(event)
    if key is not None:
      with _lock:
        _counts[key] += duration

  monitoring.register_event_listener(on_event)
  monitoring.register_event_duration_secs_listener(on_duration)
  _listening = True


def compile_seconds() -> float:
  """Seconds this process has spent compiling programs with XLA, or loading them from the cache, since the
  first call of this (or of setup()); differences time the compiling inside a span."""
  _listen()
  with _lock:
    return _counts["compile_s"]


def stats() -> dict:
  """{dir, requests, hits, written, saved_s, compile_s} since setup(): lookups, entries loaded, entries written,
  the compile seconds the loaded entries had cost, and the seconds spent compiling or loading."""
  with _lock:
    return {"dir": _dir, **_counts}


def describe() -> str:
  """One phrase for a log line, e.g. "compilation cache ~/.cache/erpo-jax/xla: 5 of 7 programs loaded"."""
  s = stats()
  if s["dir"] is None:
    return "no compilation cache"
  return (f"compilation cache {s['dir']}: {s['hits']} of {s['requests']} programs loaded "
          f"({max(0.0, s['saved_s']):.1f} s of compiling saved), {s['written']} written")

"""Makes the shared test helpers in tests/ (tiny_runs, kernel_builds) importable from tests/unit/** and
tests/e2e/, and sets the suite's XLA environment, which every subprocess of a test inherits:

- Tests never write to the user's compilation cache (~/.cache/erpo-jax/xla): erpo-jax sets up none
  (ERPO_JAX_CACHE_DIR=off). The suite has its own, JAX's persistent cache in
  $TMPDIR/erpo-jax-test-xla-cache-<uid>, shared by both xdist workers and every subprocess, so a program
  one test compiled is loaded by the next test that builds it (in the workers, each program that took
  0.25 s or more to compile; in training subprocesses, every program: tests/tiny_runs.py).
- XLA's CPU backend compiles at optimization level 0 (--xla_backend_optimization_level=0 in XLA_FLAGS):
  the same HLO programs, with LLVM's optimizations of the generated code off. The suite's tiny models
  spend far more time compiling than running; a level already in XLA_FLAGS is kept, so
  XLA_FLAGS=--xla_backend_optimization_level=3 runs the suite on the code users run.
"""

import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
os.environ.setdefault("ERPO_JAX_CACHE_DIR", "off")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(tempfile.gettempdir()) / f"erpo-jax-test-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# 8 CPU devices on 2 cores beside the other worker: XLA ends the process when a device thread reaches a
# collective more than 40 s (its default) after the others. 120 s leaves room for a loaded host and still
# ends a deadlocked process in two minutes (mesh.conditional_collectives_unsafe and multihost.cpu_xla_threads
# name the ones seen; tests start multi-device processes with multihost.cpu_device_env).
if "--xla_cpu_collective_call_terminate_timeout_seconds" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=120"

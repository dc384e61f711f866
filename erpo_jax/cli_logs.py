"""What the erpo-jax command keeps off the terminal: library logs and tracebacks that repeat, or misstate, what
the command reports itself in one line or in the run's metrics."""

from __future__ import annotations

import importlib
import logging
import sys
import threading

from erpo_jax.errors import USER_ERRNOS


class OrbaxNoise(logging.Filter):
  """Orbax's error logs (a traceback from each thread of a failed checkpoint write) and two of its warnings:
  that an item folder (params/) has no _CHECKPOINT_METADATA of its own, which every restore of one item prints
  although the checkpoint's metadata is one level up; and "Waiting for previous save to complete took ...
  seconds", which a save prints for the trainer's own wait on the write before, steps earlier (the step that
  waited logs it as time/checkpoint_wait)."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if record.levelno == logging.WARNING and message.startswith(("Metadata file does not exist",
                                                                 "Waiting for previous save to complete")):
      return False
    return not (record.levelno >= logging.ERROR and "orbax" in f"{record.pathname} {message}")


def install() -> None:
  """Installs the filter and hooks here, once per process (main() may run more than once in one).

  A failed checkpoint write reaches the user as ONE line (CheckpointWriteError, raised by the trainer).
  Orbax also logs it from each of its writer threads, and tensorstore's late callbacks
  into Orbax's closed event loop print "Event loop is closed" tracebacks; those are dropped.
  """
  importlib.import_module("absl.logging")  # creates the "absl" logger the filter goes on (heavy: only here)
  if any(isinstance(f, OrbaxNoise) for f in logging.getLogger("absl").filters):
    return
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(OrbaxNoise())
  previous = sys.unraisablehook

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)

  sys.unraisablehook = hook

  # A writer thread (TensorBoard's) that fails on a full disk or a permission is reported by the main
  # thread in one line (MetricsWriter checks the thread); its own traceback is dropped.
  previous_thread_hook = threading.excepthook

  def thread_hook(args):
    if not (isinstance(args.exc_value, OSError) and args.exc_value.errno in USER_ERRNOS):
      previous_thread_hook(args)

  threading.excepthook = thread_hook

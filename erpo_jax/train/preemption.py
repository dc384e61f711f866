"""Preemption: SIGTERM (what a scheduler sends before it takes the machine) asks the loop to stop cleanly."""

from __future__ import annotations

import signal


class Preemption:
  """SIGTERM sets a flag; the loop finishes the step, saves, and exits 0."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    self._old = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    signal.signal(signal.SIGTERM, self._old)

"""Verifiable rewards: extract each response's final answer and check it against the ground truth.

    reward_i = (correct if equivalent(answer_i, truth_i) else wrong) + format_bonus * [answer_i found]

Extraction, screening and the cheap number/string comparison run in this process;
only answers that need math-verify's parser go to a pool of worker processes
(`python -m erpo_jax.reward.verify`, started with exec, never forked from a JAX process).
Each such answer gets `reward.timeout_s`; a worker past its limit is killed and
replaced, a worker that dies is replaced, and in both cases only that row scores
`reward.wrong` (counted in `timeouts` / `crashes` and logged as a warning).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
import select
import subprocess
import sys
import time

import numpy as np

from erpo_jax.config import RewardSection
from erpo_jax.reward.verify import extract_answer, is_equivalent, quick_equivalent  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a worker must import math-verify and report ready within this
_SOFT_FRACTION = 0.8  # the worker's own alarm fires at 0.8 * timeout_s, the parent kills at timeout_s


@dataclasses.dataclass(frozen=True)
class RewardResult:
  rewards: np.ndarray  # [N] float32
  correct: np.ndarray  # [N] bool
  extracted: list[str | None]  # [N] final answers found (None = none or refused)
  timeouts: int  # rows whose verification ran past reward.timeout_s
  crashes: int  # rows whose worker process died


class _Worker:
  """One verifier process speaking JSON lines over its stdin/stdout pipes."""

  def __init__(self):
    env = dict(os.environ)
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # A session of its own: a preemption SIGTERM or Ctrl-C sent to the trainer's process group
    # must not kill a worker mid-answer (the trainer closes its workers itself).
    self.proc = subprocess.Popen([sys.executable, "-m", "erpo_jax.reward.verify"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, env=env, bufsize=0, start_new_session=True)
    self.fd = self.proc.stdout.fileno()
    self.buf = b""
    self.ready = False
    self.started = time.monotonic()
    self.task: int | None = None  # index of the pending answer
    self.deadline = 0.0

  def send(self, task: int, pred: str, truth: str, timeout_s: float) -> bool:
    msg = json.dumps({"id": task, "pred": pred, "truth": truth, "soft_s": _SOFT_FRACTION * timeout_s})
    try:
      self.proc.stdin.write(msg.encode() + b"\n")
    except (BrokenPipeError, OSError):
      return False
    self.task, self.deadline = task, time.monotonic() + timeout_s
    return True

  def read_lines(self) -> list[dict] | None:
    """Complete messages available now; None at end of file (the process died)."""
    chunk = os.read(self.fd, 65536)
    if not chunk:
      return None
    self.buf += chunk
    *lines, self.buf = self.buf.split(b"\n")
    return [json.loads(l) for l in lines if l.strip()]

  def kill(self) -> None:
    try:
      self.proc.kill()
    except OSError:
      pass
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass

  def stop(self) -> None:
    try:
      self.proc.stdin.close()  # end of input: the worker's loop ends
      self.proc.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
      pass
    self.kill()


class Verifier:
  """Scores responses against ground-truth answers with a per-answer time limit.

  Usage: `with Verifier(cfg.reward) as v: result = v.score(responses, answers)`.
  Workers start on the first answer that needs them.
  """

  def __init__(self, reward: RewardSection):
    self.cfg = reward
    self._workers: list[_Worker] = []
    self.total_timeouts = 0
    self.total_crashes = 0

  def __enter__(self) -> Verifier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  (interpreter shutdown)
      pass

  def close(self) -> None:
    for w in self._workers:
      w.stop()
    self._workers = []

  def score(self, responses: list[str], answers: list[str]) -> RewardResult:
    """Rewards of N responses; answers[i] is the ground truth of responses[i]."""
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    N = len(responses)
    extracted = [extract_answer(r, self.cfg.extract) for r in responses]
    correct_N = np.zeros(N, dtype=np.bool_)
    pending = []
    for i, (pred, truth) in enumerate(zip(extracted, answers)):
      if pred is None:
        continue
      quick = quick_equivalent(pred, str(truth))
      if quick is None:
        pending.append(i)
      else:
        correct_N[i] = quick
    timeouts = crashes = 0
    if pending:
      ok, timeouts, crashes = self._run([(extracted[i], str(answers[i])) for i in pending])
      correct_N[pending] = ok
    if timeouts or crashes:
      self.total_timeouts += timeouts
      self.total_crashes += crashes
      log.warning("verifier: %d answer(s) timed out after %.1f s and %d worker crash(es) in a batch of %d; "
                  "those rows scored reward.wrong (totals: %d timeouts, %d crashes)", timeouts,
                  self.cfg.timeout_s, crashes, N, self.total_timeouts, self.total_crashes)
    found_N = np.array([e is not None for e in extracted], dtype=np.bool_)
    rewards_N = np.where(correct_N, self.cfg.correct, self.cfg.wrong) + self.cfg.format_bonus * found_N
    return RewardResult(rewards=rewards_N.astype(np.float32), correct=correct_N, extracted=extracted,
                        timeouts=timeouts, crashes=crashes)

  # --------------------------------------------------------------------------- the pool

  def _run(self, tasks: list[tuple[str, str]]) -> tuple[np.ndarray, int, int]:
    """math-verify on each (pred, truth) in the workers: (ok [T] bool, timeouts, crashes)."""
    ok = np.zeros(len(tasks), dtype=np.bool_)
    queue = collections.deque(range(len(tasks)))
    timeouts = crashes = 0
    failed_starts = 0
    while len(self._workers) < min(self.cfg.workers, len(tasks)):
      self._workers.append(_Worker())

    def replace(w: _Worker) -> None:
      w.kill()
      self._workers[self._workers.index(w)] = _Worker()

    while queue or any(w.task is not None for w in self._workers):
      for w in self._workers:
        while w.ready and w.task is None and queue:
          t = queue.popleft()
          if not w.send(t, *tasks[t], self.cfg.timeout_s):
            queue.appendleft(t)
            replace(w)
            break
      now = time.monotonic()
      waiting = [w for w in self._workers if not w.ready or w.task is not None]
      deadlines = [w.deadline if w.ready else w.started + _START_TIMEOUT_S for w in waiting]
      wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
      readable, _, _ = select.select([w.fd for w in waiting], [], [], wait_s)
      for w in list(waiting):
        if w.fd in readable:
          msgs = w.read_lines()
          if msgs is None:  # the process died
            if w.task is not None:
              crashes += 1
              w.task = None
            else:
              failed_starts += 1
              if failed_starts > 3:
                raise RuntimeError("verifier workers fail to start (python -m erpo_jax.reward.verify); see stderr")
            replace(w)
            continue
          for m in msgs:
            if m.get("ready"):
              w.ready = True
            elif m.get("id") == w.task:
              ok[w.task] = bool(m["ok"])
              timeouts += bool(m["timeout"])
              w.task = None
        elif w.task is not None and time.monotonic() >= w.deadline:
          timeouts += 1
          w.task = None
          replace(w)
        elif not w.ready and time.monotonic() >= w.started + _START_TIMEOUT_S:
          raise RuntimeError(f"a verifier worker did not start within {_START_TIMEOUT_S:.0f} s")
    return ok, timeouts, crashes

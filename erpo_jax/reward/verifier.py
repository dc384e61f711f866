"""Verifiable rewards: extract each response's final answer and check it against the ground truth.

    reward_i = (correct if equivalent(answer_i, truth_i) else wrong) + format_bonus * [answer_i found]

Extraction, screening and the cheap number/string comparison run in this process;
only answers that need math-verify's parser go to a pool of worker processes
(`python -m erpo_jax.reward.verify`, started with exec, never forked from a JAX process).

A verdict does not depend on how busy the machine is: workers are warmed up (sympy's
lazy imports paid) before they report ready, and `with Verifier(...)` waits for them;
each answer's budget, `reward.timeout_s`, is CPU time of its worker (the worker's own
ITIMER_PROF alarm at 0.8 of it, the parent's kill at all of it), not wall time; and every
verdict is cached by (extracted answer, ground truth) for the Verifier's life. A worker
that sleeps without progress for timeout_s of wall time is hung and killed; a worker that
dies is replaced. Those rows score `reward.wrong` and are counted in `timeouts` /
`crashes` (a timeout is a verdict and cached, a crash is not).
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
from erpo_jax.reward.extract import extract_answer
from erpo_jax.reward.verify import quick_equivalent

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a worker must import math-verify and report ready within this
_SOFT_FRACTION = 0.8  # the worker's own CPU-time alarm fires at 0.8 * timeout_s, the parent kills at timeout_s
_WALL_FACTOR = 30.0  # last resort: a worker past 30 x timeout_s of wall time on one answer is killed
_POLL_S = 0.05  # how often the parent reads its workers' CPU time
_CACHE_SIZE = 1 << 16  # verdicts kept (least recently used dropped)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_and_state(pid: int) -> tuple[float, str] | None:
  """(user + system CPU seconds, scheduler state letter) of a process, from /proc; None where unreadable."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read().decode()
  except OSError:
    return None
  fields = stat[stat.rindex(")") + 2:].split()  # fields 3.. of proc(5): state, ppid, ...
  return (int(fields[11]) + int(fields[12])) / _CLK_TCK, fields[0]


@dataclasses.dataclass(frozen=True)
class RewardResult:
  rewards: np.ndarray  # [N] float32
  correct: np.ndarray  # [N] bool
  extracted: list[str | None]  # [N] final answers found (None = none or refused)
  timeouts: int  # rows whose verification ran past reward.timeout_s of CPU time (or hung)
  crashes: int  # rows whose worker process died
  cached: int = 0  # rows whose verdict came from the cache of earlier batches


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
    self.sent = 0.0  # wall time the pending answer was sent
    self.cpu0: float | None = None  # the worker's CPU seconds then (None: no /proc)
    self.progress = (0.0, 0.0)  # (wall time, CPU seconds) of its last CPU progress

  def send(self, task: int, pred: str, truth: str, timeout_s: float) -> bool:
    msg = json.dumps({"id": task, "pred": pred, "truth": truth, "soft_s": _SOFT_FRACTION * timeout_s})
    usage = _cpu_and_state(self.proc.pid)
    try:
      self.proc.stdin.write(msg.encode() + b"\n")
    except (BrokenPipeError, OSError):
      return False
    self.task, self.sent = task, time.monotonic()
    self.cpu0 = usage[0] if usage else None
    self.progress = (self.sent, self.cpu0 or 0.0)
    return True

  def over_budget(self, timeout_s: float) -> bool:
    """Whether the pending answer has used timeout_s of CPU time, or the worker is hung.

    Hung: not running and no CPU progress for timeout_s of wall time (a starved worker is
    running, so load never counts), or past _WALL_FACTOR x timeout_s of wall time. Without
    /proc the limit is timeout_s of wall time.
    """
    now = time.monotonic()
    if self.cpu0 is None:
      return now - self.sent >= timeout_s
    usage = _cpu_and_state(self.proc.pid)
    if usage is None:
      return False  # it exited: the pipe reports that
    cpu, state = usage
    if cpu - self.cpu0 >= timeout_s:
      return True
    if cpu > self.progress[1]:
      self.progress = (now, cpu)
    stalled = state not in ("R",) and now - self.progress[0] >= timeout_s
    if stalled:  # an answer written just before the read of the state is taken, not discarded
      if select.select([self.fd], [], [], 0)[0]:
        return False
    return stalled or now - self.sent >= _WALL_FACTOR * timeout_s

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
  """Scores responses against ground-truth answers with a per-answer CPU-time limit.

  Usage: `with Verifier(cfg.reward) as v: result = v.score(responses, answers)`; entering
  starts the workers and waits until they are warm. Without `with`, workers start on
  the first answer that needs them.
  """

  def __init__(self, reward: RewardSection):
    self.cfg = reward
    self._workers: list[_Worker] = []
    self._cache: collections.OrderedDict[tuple[str, str], tuple[bool, bool]] = collections.OrderedDict()
    self.total_timeouts = 0
    self.total_crashes = 0
    self.total_scored = 0  # responses scored
    self.total_cached = 0  # of which answered from the verdict cache

  def __enter__(self) -> Verifier:
    self.warm()
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  (interpreter shutdown)
      pass

  def warm(self) -> float:
    """Starts reward.workers workers and waits until each reports ready; returns the seconds taken."""
    t0 = time.monotonic()
    self._run([])
    return time.monotonic() - t0

  def close(self) -> None:
    if self._workers and self.total_scored:
      log.log(logging.WARNING if self.total_timeouts else logging.INFO,
              "verifier: %d responses scored, %d timed out (%.2f%%), %d worker crashes, %d verdicts from the cache",
              self.total_scored, self.total_timeouts, 100.0 * self.timeout_rate, self.total_crashes, self.total_cached)
    for w in self._workers:
      w.stop()
    self._workers = []

  @property
  def timeout_rate(self) -> float:
    """Fraction of all responses scored so far whose verification timed out."""
    return self.total_timeouts / max(1, self.total_scored)

  def score(self, responses: list[str], answers: list[str]) -> RewardResult:
    """Rewards of N responses; answers[i] is the ground truth of responses[i]."""
    if len(responses) != len(answers):
      raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    N = len(responses)
    truths = [str(a) for a in answers]
    extracted = [extract_answer(r, self.cfg.extract, gold=t) for r, t in zip(responses, truths)]
    correct_N = np.zeros(N, dtype=np.bool_)
    timed_out_N = np.zeros(N, dtype=np.bool_)
    pending: dict[tuple[str, str], list[int]] = {}
    cached = 0
    for i, (pred, truth) in enumerate(zip(extracted, truths)):
      if pred is None:
        continue
      key = (pred, truth)
      if key in self._cache:
        self._cache.move_to_end(key)
        correct_N[i], timed_out_N[i] = self._cache[key]
        cached += 1
        continue
      quick = quick_equivalent(pred, truth)
      if quick is None:
        pending.setdefault(key, []).append(i)
      else:
        correct_N[i] = quick
        self._remember(key, (quick, False))
    crashes = 0
    if pending:
      keys = list(pending)
      ok, timed_out, crashed = self._run(keys)
      crashes = sum(len(pending[k]) for k, c in zip(keys, crashed) if c)
      for k, o, t, c in zip(keys, ok, timed_out, crashed):
        correct_N[pending[k]], timed_out_N[pending[k]] = o, t
        if not c:
          self._remember(k, (bool(o), bool(t)))
    timeouts = int(timed_out_N.sum())
    self.total_scored += N
    self.total_cached += cached
    if timeouts or crashes:
      self.total_timeouts += timeouts
      self.total_crashes += crashes
      log.warning("verifier: %d answer(s) timed out after %.1f s of CPU time and %d worker crash(es) in a batch "
                  "of %d; those rows scored reward.wrong (totals: %d timeouts, %.2f%% of %d responses, %d crashes)",
                  timeouts, self.cfg.timeout_s, crashes, N, self.total_timeouts, 100.0 * self.timeout_rate,
                  self.total_scored, self.total_crashes)
    found_N = np.array([e is not None for e in extracted], dtype=np.bool_)
    rewards_N = np.where(correct_N, self.cfg.correct, self.cfg.wrong) + self.cfg.format_bonus * found_N
    return RewardResult(rewards=rewards_N.astype(np.float32), correct=correct_N, extracted=extracted,
                        timeouts=timeouts, crashes=crashes, cached=cached)

  def _remember(self, key: tuple[str, str], verdict: tuple[bool, bool]) -> None:
    self._cache[key] = verdict
    if len(self._cache) > _CACHE_SIZE:
      self._cache.popitem(last=False)

  # --------------------------------------------------------------------------- the pool

  def _run(self, tasks: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """math-verify on each (pred, truth) in the workers: (ok, timed out, crashed), each [T] bool.

    With no tasks it starts reward.workers workers and waits until they are ready.
    """
    ok = np.zeros(len(tasks), dtype=np.bool_)
    timed_out = np.zeros(len(tasks), dtype=np.bool_)
    crashed = np.zeros(len(tasks), dtype=np.bool_)
    queue = collections.deque(range(len(tasks)))
    failed_starts = 0
    while len(self._workers) < (min(self.cfg.workers, len(tasks)) if tasks else self.cfg.workers):
      self._workers.append(_Worker())

    def replace(w: _Worker) -> None:
      w.kill()
      self._workers[self._workers.index(w)] = _Worker()

    while queue or any(w.task is not None or (not tasks and not w.ready) for w in self._workers):
      for w in self._workers:
        while w.ready and w.task is None and queue:
          t = queue.popleft()
          if not w.send(t, *tasks[t], self.cfg.timeout_s):
            queue.appendleft(t)
            replace(w)
            break
      waiting = [w for w in self._workers if not w.ready or w.task is not None]
      if not waiting:
        continue
      readable, _, _ = select.select([w.fd for w in waiting], [], [], _POLL_S)
      for w in list(waiting):
        if w.fd in readable:
          msgs = w.read_lines()
          if msgs is None:  # the process died
            if w.task is not None:
              crashed[w.task] = True
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
              timed_out[w.task] = bool(m["timeout"])
              w.task = None
        elif w.task is not None and w.over_budget(self.cfg.timeout_s):
          timed_out[w.task] = True
          w.task = None
          replace(w)
        elif not w.ready and time.monotonic() >= w.started + _START_TIMEOUT_S:
          raise RuntimeError(f"a verifier worker did not start within {_START_TIMEOUT_S:.0f} s")
    return ok, timed_out, crashed

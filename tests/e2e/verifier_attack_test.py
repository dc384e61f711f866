"""End-to-end verifier under attack: adversarial outputs cost at most the per-answer limit and zero only their row.

Everything goes through erpo_jax.reward.verifier.Verifier with real worker processes:
megabyte outputs, deep nesting, power towers, million-digit integers, LaTeX on
which the CAS runs for minutes, and workers that crash or hang (the
ERPO_JAX_VERIFY_FAULT hook of erpo_jax.reward.verify).
"""

import logging
import time

import numpy as np
import pytest

from erpo_jax.config import RewardSection
from erpo_jax.reward.verifier import Verifier

LIMIT_S = 2.0  # reward.timeout_s
SLACK_S = 1.0  # scheduling slack on a loaded machine

# (response, ground truth)
NORMAL_RIGHT = [
    ("7 + 5 = 12, so the answer is \\boxed{12}.", "12"),  # decided in this process
    ("Half of it: \\boxed{\\frac{1}{2}}", "0.5"),
    ("#### 1,000", "1000"),
    ("Expanding, \\boxed{(x+1)^2}", "x^2+2x+1"),  # needs math-verify in a worker
    ("So \\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
]
NORMAL_WRONG = [
    ("\\boxed{13}", "12"),
    ("\\boxed{x^2+1}", "x^2+2x+1"),
    ("I do not know.", "7"),
]
SCREENED = {  # refused by the screen in this process: never parsed, scored wrong at once
    "1 MB of text, answer buried at the start": ("\\boxed{42} " + "lorem ipsum " * 90_000, "42"),
    "deeply nested braces": ("\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}", "1"),
    "power tower": ("\\boxed{10^{10^{10}}}", "10"),
    "huge exponent": ("\\boxed{2^{123456789}}", "2"),
    "10^6-digit integer": ("The answer is " + "9" * 1_000_000, "9"),
    "10^6-digit boxed integer": ("\\boxed{" + "1" * 1_000_000 + "}", "1"),
    "huge factorial": ("\\boxed{99999999!}", "1"),
}
CAS_HANGS = {  # pass the screen; sympy runs for minutes on them
    "expand a 9999th power": ("\\boxed{(x+1)^{9999}}", "x^2+2x+1"),
    "trigonometric 9999th powers": ("\\boxed{\\sin(x)^{9999}+\\cos(x)^{9999}}", "1"),
    "product of 9999 factors": ("\\boxed{\\prod_{k=1}^{9999}(x+k)}", "0"),
}
MEGABYTE_RIGHT = ("lorem ipsum " * 90_000 + "\\boxed{42}", "42")  # 1 MB, the answer where answers are


@pytest.fixture(scope="module")
def verifier():
  t0 = time.perf_counter()
  with Verifier(RewardSection(workers=2, timeout_s=LIMIT_S)) as v:
    v.startup_s = time.perf_counter() - t0  # starting and warming the workers
    yield v


def _warm(v: Verifier) -> float:
  """Waits until every worker is up (a replaced one starts in the background); returns the seconds that took."""
  return v.warm()


def _slowdown() -> float:
  """Wall time over CPU time of a short busy loop here: how much a CPU-time limit stretches in wall time now."""
  t0, c0 = time.perf_counter(), time.process_time()
  while time.process_time() - c0 < 0.2:
    pass
  return max(1.0, (time.perf_counter() - t0) / (time.process_time() - c0))


@pytest.mark.parametrize("name", list(SCREENED))
def test_screened_attack_scores_zero_in_a_fraction_of_the_limit(verifier, name):
  response, truth = SCREENED[name]
  t0 = time.perf_counter()
  result = verifier.score([response], [truth])
  assert time.perf_counter() - t0 < 0.25 * LIMIT_S
  assert result.rewards.tolist() == [0.0] and result.extracted == [None]
  assert result.timeouts == 0 and result.crashes == 0


@pytest.mark.parametrize("name", list(CAS_HANGS))
def test_cas_hang_scores_zero_within_the_per_answer_limit(verifier, name):
  _warm(verifier)
  response, truth = CAS_HANGS[name]
  slowdown = _slowdown()
  t0 = time.perf_counter()
  result = verifier.score([response], [truth])
  elapsed = time.perf_counter() - t0
  # The limit is the worker's CPU time: on a busy machine its wall time stretches by the slowdown.
  assert elapsed < 1.5 * slowdown * LIMIT_S + SLACK_S, (elapsed, slowdown)
  assert result.rewards.tolist() == [0.0] and result.timeouts == 1 and result.crashes == 0


def test_a_megabyte_output_with_the_answer_at_its_end_is_scored_right(verifier):
  t0 = time.perf_counter()
  result = verifier.score([MEGABYTE_RIGHT[0]], [MEGABYTE_RIGHT[1]])
  assert time.perf_counter() - t0 < 0.25 * LIMIT_S
  assert result.rewards.tolist() == [1.0]


def test_realistic_batch_mixing_attacks_and_answers_scores_every_row_in_bounded_time(verifier, caplog):
  rows = NORMAL_RIGHT + list(SCREENED.values()) + NORMAL_WRONG + list(CAS_HANGS.values()) + [MEGABYTE_RIGHT]
  expected = ([1.0] * len(NORMAL_RIGHT) + [0.0] * len(SCREENED) + [0.0] * len(NORMAL_WRONG) + [0.0] * len(CAS_HANGS)
              + [1.0])
  order = np.random.default_rng(0).permutation(len(rows))  # attacks spread through the batch
  responses, truths = zip(*[rows[i] for i in order])
  _warm(verifier)
  startup_s, slowdown = verifier.startup_s, _slowdown()
  caplog.set_level(logging.WARNING, logger="erpo_jax.reward.verifier")
  t0 = time.perf_counter()
  result = verifier.score(list(responses), list(truths))
  elapsed = time.perf_counter() - t0
  np.testing.assert_array_equal(result.rewards, np.asarray(expected, np.float32)[order])
  assert result.timeouts == len(CAS_HANGS) and result.crashes == 0
  # At worst the hangs queue on one worker, each followed by starting its replacement.
  assert elapsed < len(CAS_HANGS) * (1.5 * slowdown * LIMIT_S + startup_s) + SLACK_S, (elapsed, startup_s, slowdown)
  assert f"{len(CAS_HANGS)} answer(s) timed out" in caplog.text


def test_crashing_workers_zero_only_their_rows_with_a_counted_warning(monkeypatch, caplog):
  monkeypatch.setenv("ERPO_JAX_VERIFY_FAULT", "crash:CRASH_ME")
  crash = ("\\boxed{CRASH_ME}", "x^2")
  rows = [NORMAL_RIGHT[3], crash, NORMAL_RIGHT[4], NORMAL_RIGHT[0], crash, NORMAL_RIGHT[5], NORMAL_WRONG[1]]
  expected = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
  caplog.set_level(logging.WARNING, logger="erpo_jax.reward.verifier")
  # One worker: every row after a crash is served by its replacement.
  t0 = time.perf_counter()
  with Verifier(RewardSection(workers=1, timeout_s=LIMIT_S)) as v:  # entering starts and warms the worker
    startup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = v.score(*map(list, zip(*rows)))
    elapsed = time.perf_counter() - t0
    assert result.rewards.tolist() == expected
    assert result.crashes == 2 and result.timeouts == 0 and v.total_crashes == 2
    assert elapsed < 2 * startup_s + LIMIT_S + SLACK_S, (elapsed, startup_s)
    assert v.score([NORMAL_RIGHT[3][0]], [NORMAL_RIGHT[3][1]]).rewards.tolist() == [1.0]  # the pool is healthy
  assert "2 worker crash(es) in a batch of 7" in caplog.text


def test_a_worker_that_ignores_its_alarm_is_killed_at_the_limit_and_replaced(monkeypatch):
  monkeypatch.setenv("ERPO_JAX_VERIFY_FAULT", "hang:HANG_ME")  # the worker blocks SIGALRM and sleeps forever
  rows = [NORMAL_RIGHT[3], ("\\boxed{HANG_ME}", "x"), NORMAL_RIGHT[4], NORMAL_RIGHT[5]]
  t0 = time.perf_counter()
  with Verifier(RewardSection(workers=2, timeout_s=LIMIT_S)) as v:
    startup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = v.score(*map(list, zip(*rows)))
    elapsed = time.perf_counter() - t0
  assert result.rewards.tolist() == [1.0, 0.0, 1.0, 1.0]
  assert result.timeouts == 1 and result.crashes == 0
  assert LIMIT_S <= elapsed < LIMIT_S + startup_s + SLACK_S, (elapsed, startup_s)

"""Rewards users can trust: answers read as the graders read them, and verdicts that do not depend on load."""

import logging
import subprocess
import sys
import time

import numpy as np
import pytest

from erpo_jax.config import RewardSection
from erpo_jax.reward.extract import all_boxed, extract_answer, gold_answer, has_several_elements
from erpo_jax.reward.verifier import Verifier
from erpo_jax.reward.verify import is_equivalent, normalize, quick_equivalent

# (response, ground truth, expected correct) through Verifier.score with reward.extract=auto
CASES = [
    # several boxed answers for a gold that lists several
    ("\\boxed{-2} and \\boxed{1}", "1, -2", True),
    ("The roots are $\\boxed{1}$ and $\\boxed{-2}$.", "-2,1", True),
    ("\\boxed{-2}, \\boxed{1}, \\boxed{3}", "1, -2", False),  # an extra candidate does not pay
    ("\\boxed{1} and \\boxed{1}", "1, -2", False),
    ("\\boxed{(1, 2)} and \\boxed{(2, 1)}", "(2,1),(1,2)", True),
    ("\\boxed{1} \\boxed{2} \\boxed{3}", "\\{1,2,3\\}", True),
    ("\\boxed{3} ... no, \\boxed{4}", "4", True),  # one gold element: the last box
    # lists are not thousands-separated numbers
    ("\\boxed{32, 349}", "32349", False),
    ("\\boxed{2, 500}", "2500", False),
    ("\\boxed{32,349}", "32349", True),
    ("\\boxed{1,234,567}", "1234567", True),
    ("\\boxed{32, 349}", "32, 349", True),
    # LaTeX numbers, boxed and not
    ("\\boxed{14{,}916}", "14916", True),
    ("#### 14{,}916", "14916", True),
    ("#### \\frac{1}{4}", "1/4", True),
    ("#### \\dfrac{3}{4}", "0.75", True),
    ("#### 1\\!000", "1000", True),
    ("#### 72 apples", "72", True),
    ("#### \\$42.", "42", True),
    ("So the total is 14{,}916 dollars.", "14916", True),
    ("so she needs 2\\frac{1}{3} cups", "7/3", True),
    ("\\boxed{2\\frac{1}{3}}", "2/3", False),
    ("\\boxed{2\\frac{1}{3}}", "\\frac{7}{3}", True),
    ("\\boxed{45^\\circ}", "45", True),
    ("\\boxed{50\\%}", "0.5", True),
    ("\\boxed{12\\text{ cm}}", "12", True),
    ("The answer is 30\\% of it.", "30", True),
    ("Final Answer: The final answer is $10{,}455$. I hope it is correct.", "10455", True),
    ("We get \\boxed{200}. Final Answer: The final answer is $10,455$. I hope it is correct.", "10455", True),
    # the lenient fallback never reads digits inside words
    ("AZYUK2A", "2", False),
    ("the code is x2y", "2", False),
    ("It weighs 12kg.", "12", True),
    ("The answer is $x = 3$.", "3", True),
]


@pytest.fixture(scope="module")
def verifier():
  with Verifier(RewardSection(workers=2, timeout_s=3.0)) as v:
    yield v


def test_the_issue_cases_score_as_the_graders_do(verifier):
  responses, truths, _ = zip(*CASES)
  result = verifier.score(list(responses), list(truths))
  wrong = [(r, t, e, x) for (r, t, e), got, x in zip(CASES, result.correct, result.extracted) if got != e]
  assert not wrong
  assert result.timeouts == 0 and result.crashes == 0


def test_strict_mode_reads_only_boxes():
  text = "We find 7.\n#### 8\nFinal Answer: The final answer is $9$."
  assert extract_answer(text, "boxed") is None
  assert extract_answer(text + " \\boxed{10}", "boxed") == "10"
  assert extract_answer(text, "auto") == "9"
  assert extract_answer("AZYUK2A", "last_number") is None
  assert extract_answer("AZYUK2A", "auto") is None


def test_boxes_are_joined_only_for_a_gold_of_several_elements():
  text = "\\boxed{-2} and \\boxed{1}"
  assert all_boxed(text) == ["-2", "1"]
  assert extract_answer(text, "boxed", gold="1, -2") == "-2, 1"
  assert extract_answer(text, "boxed", gold="1") == "1"
  assert extract_answer(text, "boxed") == "1"
  assert has_several_elements("1, -2") and has_several_elements("\\{1,2\\}")
  assert has_several_elements("6 \\text{ and } 8")
  assert not has_several_elements("32,349") and not has_several_elements("14{,}916")
  assert not has_several_elements("(1, 2)") and not has_several_elements("\\frac{1}{2}")


def test_thousands_groups_need_an_unambiguous_pattern():
  assert normalize("32,349") == "32349" and normalize("14{,}916") == "14916" and normalize("14 {, }916") == "14916"
  assert normalize("32, 349") == "32,349"
  assert quick_equivalent("32,349", "32349") is True
  assert not is_equivalent("32, 349", "32349")


def test_gold_answer_reads_boxes_hashes_and_math_delimiters():
  assert gold_answer("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
  assert gold_answer("\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).") == "1, -2"
  assert gold_answer("48/2 = 24\n#### 14{,}916") == "14{,}916"
  assert gold_answer("#### \\frac{1}{4}") == "\\frac{1}{4}"
  assert gold_answer("$[0,1)$") == "[0,1)"
  assert gold_answer("72") == "72"


# --------------------------------------------------------------------------- deterministic verdicts

# Each needs math-verify in a worker, 0.1-0.25 s of CPU time on an idle 2-core machine: well
# inside a 0.6 s budget of CPU time, but past it in wall time when the worker shares 2 cores with 6 busy loops.
LOADED_CASES = [
    ("\\boxed{(x+1)(x+2)(x+3)(x+4)(x+5)(x+6)}", "x^6+21x^5+175x^4+735x^3+1624x^2+1764x+720"),
    ("\\boxed{(x-y)(x+y)(x^2+y^2)(x^4+y^4)}", "x^8-y^8"),
    ("\\boxed{\\frac{(x+1)^3-(x-1)^3}{2}}", "3x^2+1"),
    ("\\boxed{\\sin(2x)}", "2\\sin x\\cos x"),
    ("\\boxed{(x+1)^{20}}", "x^{20}+20x^{19}+1"),
    ("\\boxed{(a+b+c)^4}", "a^4+b^4+c^4"),
    ("\\boxed{(x+1)^{9999}}", "x^2+2x+1"),  # past any budget: a timeout, idle or loaded
]


def _score_fresh(cfg: RewardSection):
  with Verifier(cfg) as v:
    return v.score(*map(list, zip(*LOADED_CASES)))


def test_a_verdict_under_cpu_contention_equals_the_idle_verdict():
  cfg = RewardSection(workers=1, timeout_s=0.6)
  idle = _score_fresh(cfg)
  busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(6)]
  try:
    time.sleep(0.5)
    t0 = time.perf_counter()
    loaded = _score_fresh(cfg)
    loaded_s = time.perf_counter() - t0
  finally:
    for p in busy:
      p.kill()
      p.wait()
  assert idle.correct.tolist() == [True, True, True, True, False, False, False]
  assert loaded.correct.tolist() == idle.correct.tolist(), loaded_s
  assert idle.timeouts == loaded.timeouts == 1


def test_a_worker_spinning_with_its_alarm_blocked_is_killed_at_its_cpu_budget(monkeypatch):
  monkeypatch.setenv("ERPO_JAX_VERIFY_FAULT", "spin:SPIN_ME")
  with Verifier(RewardSection(workers=1, timeout_s=1.0)) as v:
    result = v.score(["\\boxed{SPIN_ME}", "\\boxed{(x+1)^2}"], ["1", "x^2+2x+1"])
  assert result.correct.tolist() == [False, True]
  assert result.timeouts == 1 and result.crashes == 0


def test_verdicts_are_cached_by_answer_and_gold():
  with Verifier(RewardSection(workers=1, timeout_s=1.0)) as v:
    first = v.score(["\\boxed{(x+1)^2}", "\\boxed{(x+1)^{9999}}"], ["x^2+2x+1", "1"])
    second = v.score(["so \\boxed{(x+1)^2}.", "\\boxed{(x+1)^{9999}}"], ["x^2+2x+1", "1"])
  assert first.correct.tolist() == second.correct.tolist() == [True, False]
  assert first.cached == 0 and second.cached == 2
  assert first.timeouts == second.timeouts == 1  # a cached timeout still counts as one


def test_entering_a_verifier_warms_its_workers_so_the_first_answer_is_quick():
  with Verifier(RewardSection(workers=1, timeout_s=5.0)) as v:
    assert len(v._workers) == 1 and v._workers[0].ready  # pylint: disable=protected-access
    t0 = time.perf_counter()
    result = v.score(["\\boxed{(b+a)(a-b)}"], ["a^2-b^2"])
    elapsed = time.perf_counter() - t0
  assert result.correct.tolist() == [True]
  assert elapsed < 2.0, elapsed


def test_timeouts_are_counted_and_logged_with_their_rate(caplog):
  caplog.set_level(logging.INFO, logger="erpo_jax.reward.verifier")
  with Verifier(RewardSection(workers=1, timeout_s=0.5)) as v:
    result = v.score(["\\boxed{(x+1)^{9999}}", "\\boxed{3}", "\\boxed{4}", "\\boxed{5}"], ["1", "3", "4", "5"])
    assert result.timeouts == 1 and v.total_timeouts == 1
    assert v.timeout_rate == pytest.approx(0.25)
  np.testing.assert_array_equal(result.correct, [False, True, True, True])
  assert "1 answer(s) timed out after 0.5 s of CPU time" in caplog.text
  assert "25.00% of 4 responses" in caplog.text
  assert "4 responses scored, 1 timed out (25.00%)" in caplog.text


def test_the_console_progress_shows_the_timeout_rate(tmp_path, capsys):
  from erpo_jax.metrics import MetricsWriter
  with MetricsWriter(tmp_path, tensorboard=False, progress=True, total_steps=2) as writer:
    writer.write(1, {"reward/mean": 0.5, "reward/verifier_timeouts": 2.0,
                     "reward/verifier_timeout_rate": 0.0625})
  assert "timeouts=6.2%" in capsys.readouterr().err


@pytest.mark.parametrize("unit", [" ", "- ", "\\(", "\\[", "$ ", "1 ", "1{,}", "\\frac{1}{", "#### ", "1,",
                                  "2\\frac{1}{3} ", "final answer is "])
def test_extraction_stays_linear_on_long_repetitive_output(unit):
  text = unit * (65_536 // len(unit))
  t0 = time.process_time()
  for mode in ("auto", "last_number", "gsm8k", "boxed"):
    extract_answer(text, mode, gold="1, 2")
  gold_answer(text)
  assert time.process_time() - t0 < 1.0

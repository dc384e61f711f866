"""Tests of answer extraction, equivalence, screening and the worker-pool verifier."""

import time

import numpy as np
import pytest

from erpo_jax.config import RewardSection
from erpo_jax.reward.extract import extract_answer, is_pathological
from erpo_jax.reward.verifier import Verifier
from erpo_jax.reward.verify import is_equivalent, normalize, quick_equivalent

# (response, ground truth, expected correct)
CASES = [
    # equivalent spellings of one half
    ("\\boxed{1/2}", "\\frac{1}{2}", True),
    ("\\boxed{0.5}", "\\frac12", True),
    ("\\boxed{\\frac12}", "0.5", True),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", True),
    ("\\boxed{\\tfrac{1}{2}}", "0.5", True),
    ("\\boxed{.5}", "1/2", True),
    ("\\boxed{2/4}", "1/2", True),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", True),
    ("$\\boxed{\\frac{1}{2}}$.", "0.5", True),
    # units, degrees, dollars
    ("\\boxed{12 \\text{ cm}}", "12", True),
    ("\\boxed{12\\text{cm}}", "12\\text{ cm}", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{90^{\\circ}}", "90^\\circ", True),
    ("\\boxed{\\$5}", "5", True),
    ("\\boxed{5 \\text{ dollars}}", "5", True),
    ("\\boxed{6\\text{ cm}^2}", "6", True),
    # negatives
    ("\\boxed{-3}", "-3", True),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True),
    ("\\boxed{\\frac{-1}{2}}", "-1/2", True),
    ("\\boxed{3}", "-3", False),
    ("\\boxed{- 3}", "-3", True),
    # thousands separators
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{1{,}000}", "1000", True),
    ("The total is 1,234,567.", "1234567", True),
    # intervals
    ("\\boxed{(1, 2]}", "(1,2]", True),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", True),
    ("\\boxed{[0, 1]}", "(0,1)", False),
    ("\\boxed{\\left(2, 5\\right)}", "(2,5)", True),
    # sets
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}", True),
    ("\\boxed{\\{1,2\\}}", "\\{1,3\\}", False),
    # percentages
    ("\\boxed{50\\%}", "50", True),
    ("\\boxed{50}", "50\\%", True),
    ("\\boxed{0.5}", "50\\%", True),
    ("\\boxed{25\\%}", "50\\%", False),
    # symbolic forms
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{x = 3}", "3", True),
    ("\\boxed{2\\pi}", "2\\pi", True),
    ("\\boxed{\\text{(B)}}", "B", True),
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
    # wrong answers
    ("\\boxed{13}", "12", False),
    ("\\boxed{0.51}", "1/2", False),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("7 + 5 = 12.", "13", False),
    # no box: the last number counts; no number: no answer
    ("7 + 5 = 12.", "12", True),
    ("I don't know.", "12", False),
    ("", "12", False),
    ("So the answer is -7.", "-7", True),
    ("The answer is 3/4", "\\frac{3}{4}", True),
    # several boxes: the last complete one counts
    ("First \\boxed{3}, then corrected: \\boxed{4}", "4", True),
    ("\\boxed{4} ... actually \\boxed{3}", "4", False),
    ("\\boxed{5} and then \\boxed{6", "5", True),
    ("\\fbox{7}", "7", True),
    ("so \\boxed 5", "5", True),
    # GSM8K format
    ("She sold 48/2 = 24 clips in May.\n#### 72", "72", True),
    ("#### 1,000", "1000", True),
    ("48 + 24 = 72\n#### 71", "72", False),
    ("#### $42", "42", True),
    # adversarial output: refused or harmless, scored wrong
    ("x" * 1_000_000, "1", False),
    ("\\boxed{" + "{" * 100_000 + "}" * 100_000 + "}", "1", False),
    ("\\boxed{" + "9" * 1_000_000 + "}", "9", False),
    ("1" * 1_000_000, "1", False),
    ("\\boxed{10^{10^{10}}}", "10", False),
    ("\\boxed{2^{99999}}", "2", False),
    ("\\boxed{10**10**10}", "10", False),
    ("\\boxed{100000!}", "1", False),
    ("\\boxed{__import__('os').system('touch /tmp/erpo_jax_pwned')}", "0", False),
    ("\\boxed{1/0}", "1", False),
    ("\\boxed{\\frac{1}{0}}", "1", False),
]
ADVERSARIAL = slice(-11, None)


@pytest.fixture(scope="module")
def verifier():
  with Verifier(RewardSection(timeout_s=3.0, workers=2)) as v:
    yield v


def test_verifier_scores_the_case_table(verifier):
  assert len(CASES) >= 60
  responses, truths, expected = zip(*CASES)
  result = verifier.score(list(responses), list(truths))
  wrong = [(r[:60], t, e) for (r, t, e), got in zip(CASES, result.correct) if got != e]
  assert not wrong
  np.testing.assert_array_equal(result.rewards, np.asarray(expected, dtype=np.float32))
  assert result.rewards.dtype == np.float32 and result.correct.dtype == np.bool_
  assert result.timeouts == 0 and result.crashes == 0


def test_adversarial_outputs_score_zero_well_within_the_limit(verifier):
  responses, truths, _ = zip(*CASES[ADVERSARIAL])
  verifier.score(["\\boxed{(x+1)^2}"], ["x^2+2x+1"])  # workers already running
  t0 = time.perf_counter()
  result = verifier.score(list(responses), list(truths))
  elapsed = time.perf_counter() - t0
  assert elapsed < 1.5, elapsed  # reward.timeout_s = 3
  assert not result.correct.any() and result.timeouts == 0
  assert result.extracted[:8] == [None] * 8  # refused by the screen, never parsed
  assert not __import__("os").path.exists("/tmp/erpo_jax_pwned")


@pytest.mark.parametrize("answer", ["10^{10^{10}}", "2^{12345}", "10**10**10", "2^3^4", "123456!", "{" * 40 + "}" * 40,
                                    "1" * 600])
def test_pathological_answers_are_refused(answer):
  assert is_pathological(answer)


@pytest.mark.parametrize("answer", ["2^{10}", "x^2+2x+1", "10^{100}", "5!", "\\frac{\\sqrt{3}}{2}", "e^{i\\pi}"])
def test_ordinary_powers_are_not_refused(answer):
  assert not is_pathological(answer)


def test_extract_modes_pick_their_own_format():
  text = "We get \\boxed{3}. Check: 2 + 2 = 4\n#### 5\nso 6"
  assert extract_answer(text, "boxed") == "3"
  assert extract_answer(text, "gsm8k") == "5"
  assert extract_answer(text, "last_number") == "6"
  assert extract_answer(text, "auto") == "3"
  assert extract_answer("#### 5\nso 6", "auto") == "5"
  assert extract_answer("no digits", "boxed") is None
  assert extract_answer("\\boxed{\\frac{a}{\\sqrt{b}}} end", "boxed") == "\\frac{a}{\\sqrt{b}}"


def test_normalize_strips_decoration():
  assert normalize("$1{,}000.$") == "1000"
  assert normalize("\\left( 1, 2 \\right]") == "(1,2]"
  assert normalize("\\dfrac12") == "\\frac{1}{2}"
  assert normalize("12\\,\\text{cm}") == "12"
  assert normalize("\\text{Monday}") == "Monday"


def test_quick_comparison_is_certain_only_for_numbers():
  assert quick_equivalent("0.5", "\\frac{1}{2}") is True
  assert quick_equivalent("3", "4") is False
  assert quick_equivalent("0.3333", "\\frac13") is None  # left to math-verify
  assert quick_equivalent("(x+1)^2", "x^2+2x+1") is None


def test_is_equivalent_runs_in_process():
  assert is_equivalent("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2")
  assert not is_equivalent("\\sqrt{2}", "2")
  assert not is_equivalent("10^{10^{10}}", "10")


def test_format_bonus_is_added_when_an_answer_is_found():
  with Verifier(RewardSection(correct=1.0, wrong=-1.0, format_bonus=0.25)) as v:
    result = v.score(["\\boxed{12}", "\\boxed{13}", "no answer"], ["12", "12", "12"])
  np.testing.assert_allclose(result.rewards, [1.25, -0.75, -1.0])
  assert result.extracted == ["12", "13", None]


def test_crashed_worker_is_replaced_and_only_its_row_scores_wrong(monkeypatch):
  monkeypatch.setenv("ERPO_JAX_VERIFY_FAULT", "crash:CRASH_NOW")
  responses = ["\\boxed{(x+1)^2}", "\\boxed{CRASH_NOW}", "\\boxed{\\sqrt{8}}", "\\boxed{\\{1,2\\}}", "\\boxed{7}"]
  truths = ["x^2+2x+1", "5", "2\\sqrt{2}", "\\{2,1\\}", "7"]
  with Verifier(RewardSection(workers=2, timeout_s=5.0)) as v:
    result = v.score(responses, truths)
    assert result.crashes == 1 and result.timeouts == 0
    np.testing.assert_array_equal(result.correct, [True, False, True, True, True])
    again = v.score(["\\boxed{(x-1)^2}"], ["x^2-2x+1"])  # the replacement worker serves the next batch
    assert again.correct.tolist() == [True] and again.crashes == 0
    assert v.total_crashes == 1


def test_hung_worker_is_killed_at_the_time_limit(monkeypatch):
  monkeypatch.setenv("ERPO_JAX_VERIFY_FAULT", "hang:HANG_NOW")
  with Verifier(RewardSection(workers=1, timeout_s=1.0)) as v:
    v.score(["\\boxed{(x+1)^2}"], ["x^2+2x+1"])  # start the worker first
    t0 = time.perf_counter()
    result = v.score(["\\boxed{HANG_NOW}", "\\boxed{\\sqrt{8}}"], ["1", "2\\sqrt{2}"])
    elapsed = time.perf_counter() - t0
  assert result.timeouts == 1 and result.crashes == 0
  assert result.correct.tolist() == [False, True]
  assert 1.0 <= elapsed < 30.0  # includes starting the replacement worker


def test_mismatched_lengths_are_rejected():
  with Verifier(RewardSection()) as v, pytest.raises(ValueError):
    v.score(["a"], [])

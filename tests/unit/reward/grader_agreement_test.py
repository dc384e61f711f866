"""The reward path against published grader test suites: tests/fixtures/grader_cases.jsonl.

Cases from Math-Verify's tests, hendrycks/math's is_equiv tests and OpenAI's graded GSM8K
model solutions (scripts/make_grader_cases.py builds the file; each case names its source).
Every case where erpo-jax's verdict differs from the expected one carries the reason in
`erpo_jax_verdict_reason`.

    python tests/grader_agreement_test.py   # prints the agreement and each disagreement
"""

import collections
import json
import pathlib

import pytest

from erpo_jax.config import RewardSection
from erpo_jax.reward.extract import gold_answer
from erpo_jax.reward.verifier import Verifier

CASES_FILE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "grader_cases.jsonl"


def load_cases() -> list[dict]:
  return [json.loads(line) for line in CASES_FILE.read_text(encoding="utf-8").splitlines() if line.strip()]


def verdicts(cases: list[dict], extract: str = "auto") -> list[bool]:
  with Verifier(RewardSection(extract=extract, workers=2, timeout_s=5.0)) as v:
    result = v.score([c["pred"] for c in cases], [gold_answer(c["gold"]) for c in cases])
  assert result.timeouts == 0 and result.crashes == 0
  return [bool(x) for x in result.correct]


@pytest.fixture(scope="module")
def cases_and_verdicts():
  cases = load_cases()
  return cases, verdicts(cases)


def test_the_table_has_at_least_250_cases_each_citing_its_source():
  cases = load_cases()
  assert len(cases) >= 250
  assert all(c["source"].split("@")[0] in ("huggingface/Math-Verify", "hendrycks/math", "openai/grade-school-math")
             for c in cases)
  assert all(isinstance(c["expected"], bool) and c["pred"] and c["gold"] for c in cases)
  per_source = collections.Counter(c["source"].split("@")[0] for c in cases)
  assert per_source["huggingface/Math-Verify"] >= 200 and per_source["hendrycks/math"] == 16


def test_agreement_with_the_published_verdicts_is_at_least_98_percent(cases_and_verdicts):
  cases, got = cases_and_verdicts
  agree = sum(g == c["expected"] for c, g in zip(cases, got))
  assert agree / len(cases) >= 0.98, f"{agree}/{len(cases)}"


def test_every_disagreement_and_only_a_disagreement_carries_its_reason(cases_and_verdicts):
  cases, got = cases_and_verdicts
  unexplained = [(c["source"], c["pred"][-80:], c["gold"][:80]) for c, g in zip(cases, got)
                 if g != c["expected"] and not c.get("erpo_jax_verdict_reason")]
  stale = [(c["source"], c["pred"][-80:]) for c, g in zip(cases, got)
           if g == c["expected"] and c.get("erpo_jax_verdict_reason")]
  assert not unexplained and not stale, (unexplained, stale)


def test_graded_gsm8k_solutions_all_agree(cases_and_verdicts):
  cases, got = cases_and_verdicts
  gsm = [(c, g) for c, g in zip(cases, got) if c["source"].startswith("openai/grade-school-math")]
  assert len(gsm) == 200 and sum(c["expected"] for c, _ in gsm) >= 50
  assert all(g == c["expected"] for c, g in gsm)


def test_strict_boxed_mode_never_accepts_what_the_graders_reject():
  cases = load_cases()
  got = verdicts(cases, extract="boxed")
  false_positives = [(c["source"], c["pred"][-80:]) for c, g in zip(cases, got)
                     if g and not c["expected"] and not c.get("erpo_jax_verdict_reason")]
  assert not false_positives


if __name__ == "__main__":
  all_cases = load_cases()
  for mode in ("auto", "boxed"):
    got = verdicts(all_cases, mode)
    agree = sum(g == c["expected"] for c, g in zip(all_cases, got))
    print(f"reward.extract={mode}: {agree}/{len(all_cases)} = {100 * agree / len(all_cases):.1f}% agreement")
    by_source = collections.defaultdict(lambda: [0, 0])
    for c, g in zip(all_cases, got):
      by_source[c["source"].split("@")[0]][0] += g == c["expected"]
      by_source[c["source"].split("@")[0]][1] += 1
    for name, (a, n) in sorted(by_source.items()):
      print(f"  {name}: {a}/{n}")
    if mode == "auto":
      for c, g in zip(all_cases, got):
        if g != c["expected"]:
          print(f"  - {c['source']}: pred {c['pred'][-60:]!r}, gold {c['gold'][:60]!r}, expected {c['expected']}: "
                f"{c.get('erpo_jax_verdict_reason', 'NO REASON')}")

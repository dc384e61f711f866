"""Builds tests/fixtures/grader_cases.jsonl from published grader test suites in local checkouts.

    python scripts/make_grader_cases.py MATH_VERIFY_DIR HENDRYCKS_MATH_DIR GSM8K_DIR [COMMITS...]

MATH_VERIFY_DIR: a checkout of github.com/huggingface/Math-Verify (tests/test_*.py: every
`gold, pred, expected` case run with the library's default strict, set-relation and precision settings).
HENDRYCKS_MATH_DIR: github.com/hendrycks/math (modeling/math_equivalence_test.py: is_equiv
cases; both sides are extracted answers, so the prediction is boxed). GSM8K_DIR:
github.com/openai/grade-school-math (grade_school_math/data/example_model_solutions.jsonl:
model solutions the data set's authors marked correct or not; the first 50 problems, all four
solutions each; the gold is the number after "A:").
Each line: {"pred", "gold", "expected", "source"}; `pred` is the response given to the
verifier, `gold` the ground-truth text (erpo_jax.reward.extract.gold_answer reads its answer).
Cases where erpo-jax's verdict differs from the expected one carry `erpo_jax_verdict_reason`
(REASONS below, keyed by test, prediction and gold): why erpo-jax's verdict is the right one.
"""

import ast
import json
import pathlib
import sys

_DECIMAL_COMMA = ("erpo-jax never reads a comma as a decimal point: '1,22' may as well list two answers, 1 and 22. "
                  "A comma separates thousands (groups of exactly three digits) or list elements.")
_MULTILINE = ("The response states 9, and erpo-jax's lenient mode (reward.extract=auto) reads that last number; "
              "this case pins that math-verify's own extraction skips a math span broken over lines.")
_ORDER = ("hendrycks is_equiv compares strings, so a reordered list differs; a MATH answer listing several values "
          "is an unordered set of solutions (math-verify also scores these equal).")
REASONS = {
    ("test_number_extraction", "1000,99", "1000.99"): _DECIMAL_COMMA,
    ("test_number_extraction", "1.22", "1,22"): _DECIMAL_COMMA,
    ("test_number_extraction", "Soucis : 2,74 $ a..", "2.74"): _DECIMAL_COMMA,
    ("test_latex_notation", "Answer $ \n 9 \n $", "$9$"): _MULTILINE,
    ("test_latex_notation", "Answer \\( \n 9 \n \\)", "$9$"): _MULTILINE,
    ("test_open_thoughts", "$\\boxed{1,2}$", "\\boxed{1} no no no no no \\boxed{2}"): (
        "The gold boxes two answers, 1 and 2, and erpo-jax reads every boxed answer of a reference; math-verify "
        "drops the first box when words stand between them, which its own test_boxed case '35 cm ++++++ 4' does not."),
    ("test_order", "\\boxed{10, 4, -2}", "4, 10, -2"): _ORDER,
    ("test_decimals", "\\boxed{0.1, 4, 2}", "4, .1, 2"): _ORDER,
}


def math_verify_cases(root: pathlib.Path, commit: str):
  for f in sorted((root / "tests").glob("test_*.py")):
    tree = ast.parse(f.read_text())
    for fn in ast.walk(tree):
      if not isinstance(fn, ast.FunctionDef):
        continue
      for dec in fn.decorator_list:
        if not (isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") == "parametrize"):
          continue
        names = ast.literal_eval(dec.args[0])
        if isinstance(names, str):
          names = [n.strip() for n in names.split(",")]
        try:
          values = ast.literal_eval(dec.args[1])
        except ValueError:  # cases built by code (f-strings, calls)
          continue
        for v in values:
          row = dict(zip(names, v))
          if not {"gold", "pred", "expected"} <= row.keys():
            continue
          if (row.get("strict", True) is not True or row.get("allow_set_relation_comp", False) is not False
              or row.get("precision", 6) != 6):
            continue  # a non-default setting of the library
          yield {"pred": row["pred"], "gold": row["gold"], "expected": bool(row["expected"]),
                 "source": f"huggingface/Math-Verify@{commit[:7]} tests/{f.name}::{fn.name}"}


def hendrycks_cases(root: pathlib.Path, commit: str):
  tree = ast.parse((root / "modeling" / "math_equivalence_test.py").read_text())
  for fn in ast.walk(tree):
    if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
      continue
    env, expected = {}, None
    for stmt in fn.body:
      if isinstance(stmt, ast.Assign):
        env[stmt.targets[0].id] = ast.literal_eval(stmt.value)
      elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        expected = stmt.value.func.attr == "assertTrue"
    yield {"pred": "\\boxed{" + env["test_in"] + "}", "gold": env["test_out"], "expected": expected,
           "source": f"hendrycks/math@{commit[:7]} modeling/math_equivalence_test.py::{fn.name}"}


def gsm8k_cases(root: pathlib.Path, commit: str, problems: int = 50):
  path = root / "grade_school_math" / "data" / "example_model_solutions.jsonl"
  lines = path.read_text().splitlines()
  for i, line in enumerate(lines[:problems]):
    row = json.loads(line)
    gold = row["ground_truth"].rsplit("A:", 1)[1].strip()
    for model in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"):
      yield {"pred": row[model]["solution"], "gold": gold, "expected": bool(row[model]["is_correct"]),
             "source": f"openai/grade-school-math@{commit[:7]} grade_school_math/data/"
                       f"example_model_solutions.jsonl line {i + 1} {model}"}


def main(argv):
  mv, hm, gsm = (pathlib.Path(a) for a in argv[:3])
  commits = argv[3:6] if len(argv) >= 6 else ["unknown"] * 3
  cases = [*math_verify_cases(mv, commits[0]), *hendrycks_cases(hm, commits[1]), *gsm8k_cases(gsm, commits[2])]
  out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "grader_cases.jsonl"
  with open(out, "w", encoding="utf-8") as f:
    for c in cases:
      reason = REASONS.get((c["source"].rsplit("::", 1)[-1].split()[0], c["pred"], c["gold"]))
      if reason:
        c["erpo_jax_verdict_reason"] = reason
      f.write(json.dumps(c, ensure_ascii=False) + "\n")
  print(f"{len(cases)} cases -> {out}")


if __name__ == "__main__":
  main(sys.argv[1:])

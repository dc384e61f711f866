"""Answer equivalence and the verifier worker process (extraction: reward/extract.py).

Imports nothing heavy: `python -m erpo_jax.reward.verify` is the verifier worker that
`erpo_jax.reward.verifier.Verifier` runs in separate processes (math-verify's own
signal-based timeout is disabled there; the worker's CPU-time alarm and the parent
enforce the time limit).
No text from a model is ever evaluated as code: numbers are parsed by regular
expressions and `fractions.Fraction`, everything else goes to math-verify's parser.
"""

from __future__ import annotations

import fractions
import json
import logging
import os
import re
import signal
import sys
import time

from erpo_jax.reward.extract import is_pathological

_SPACING = re.compile(r"\\[!,;:> ]|\\quad|\\qquad|~")
_UNIT = re.compile(r"^(.*?[\d}])\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?$")
_TEXT_ONLY = re.compile(r"^\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}$")
_INT = re.compile(r"^-?\d+$")
_DEC = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_MIXED = re.compile(r"^(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")  # 2\frac{1}{3} = 7/3


def normalize(s: str) -> str:
  """A canonical spelling of a short answer for plain string/number comparison.

  Strips $ and \\$, spacing commands, \\left/\\right, degrees, a trailing period, a
  trailing unit `\\text{cm}`, thousands separators ("1,000", "1{,}000" -> "1000") and
  whitespace; \\dfrac/\\tfrac -> \\frac and \\frac12 -> \\frac{1}{2}.
  """
  s = s.strip().replace("\\$", "").replace("$", "")
  s = re.sub(r"(?<=\d)\s*\{\s*,\s*\}\s*(?=\d{3})", ",", s).replace("{,}", ",")
  s = s.replace("\\left", "").replace("\\right", "")
  s = _SPACING.sub(" ", s)
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("\\circ", "").replace("°", "")
  s = s.strip().rstrip(".").strip()
  m = _UNIT.match(s)
  if m:
    s = m.group(1)
  m = _TEXT_ONLY.match(s)
  if m:
    s = m.group(1)
  # Thousands groups only where unambiguous: "32,349" is a number, "32, 349" two.
  thousands = re.fullmatch(r"-?\s*\d{1,3}(?:,\d{3})+(?:\.\d+)?", s)
  s = re.sub(r"\s+", "", s)
  s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
  if thousands:
    s = s.replace(",", "")
  return s


def parse_number(s: str) -> tuple[fractions.Fraction, bool] | None:
  """(value, is_percent) of a normalised plain number: 12, -0.5, 3/4, \\frac{3}{4}, 2\\frac{1}{3}, 50\\%."""
  pct = s.endswith("\\%") or s.endswith("%")
  if pct:
    s = s[:-2] if s.endswith("\\%") else s[:-1]
  if len(s) > 64:
    return None
  try:
    if _INT.match(s) or _DEC.match(s):
      return fractions.Fraction(s), pct
    m = _SLASH.match(s)
    if m and int(m.group(2)) != 0:
      return fractions.Fraction(int(m.group(1)), int(m.group(2))), pct
    m = _FRAC.match(s)
    if m and int(m.group(3)) != 0:
      v = fractions.Fraction(int(m.group(2)), int(m.group(3)))
      return (-v if m.group(1) else v), pct
    m = _MIXED.match(s)
    if m and int(m.group(4)) != 0:
      v = int(m.group(2)) + fractions.Fraction(int(m.group(3)), int(m.group(4)))
      return (-v if m.group(1) else v), pct
  except (ValueError, ZeroDivisionError):
    return None
  return None


def quick_equivalent(pred: str, truth: str) -> bool | None:
  """Cheap decision without math-verify: True/False when certain, None when it needs the parser.

  Equal normalised strings are equivalent; two plain numbers are compared exactly (a
  percentage p% also matches p/100); two unequal integers are certainly different.
  """
  p, t = normalize(pred), normalize(truth)
  if p == t and p:
    return True
  np_, nt = parse_number(p), parse_number(t)
  if np_ is None or nt is None:
    return None
  (vp, pp), (vt, pt) = np_, nt
  if vp == vt or (pt and not pp and vp == vt / 100) or (pp and not pt and vp / 100 == vt):
    return True
  if vp.denominator == 1 and vt.denominator == 1 and not (pp or pt):
    return False
  if (_MIXED.match(p) or _MIXED.match(t)) and not (pp or pt):  # exact values on both sides
    return False
  return None


def math_verify_equivalent(pred: str, truth: str) -> bool:
  """math-verify's parse + verify of `\\boxed{truth}` against `\\boxed{pred}`, its own timeout off."""
  from math_verify import (  # heavy (sympy): loaded in the verifier worker, not by importers
    parse,
    verify,
  )
  gold = parse("\\boxed{" + truth + "}", parsing_timeout=None)
  target = parse("\\boxed{" + pred + "}", parsing_timeout=None)
  if not gold or not target:
    return False
  return bool(verify(gold, target, timeout_seconds=None))


def is_equivalent(pred: str, truth: str) -> bool:
  """Whether an extracted answer equals the ground truth (in this process, no time limit).

  For many answers with a time limit use `erpo_jax.reward.verifier.Verifier`.
  """
  if is_pathological(pred):
    return False
  quick = quick_equivalent(pred, truth)
  if quick is not None:
    return quick
  return math_verify_equivalent(pred, truth)


# ----------------------------------------------------------------------------- worker process


class _SoftTimeout(BaseException):
  """Raised by SIGPROF inside the worker; a BaseException so math-verify cannot swallow it."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


# Verified once before a worker reports ready, so that the lazy imports and caches of sympy's
# expansion, simplification, set, interval, matrix and trigonometry code are not paid (in CPU
# time, against the budget) by the first real answer that needs them.
WARMUP_PAIRS = (
    ("1", "1"),
    ("(x+1)(x+2)(x+3)", "x^3+6x^2+11x+6"),
    ("(a+b)(a-b)", "(b+a)(a-b)"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("\\{1, 2\\}", "\\{2, 1\\}"),
    ("(-\\infty, 3] \\cup (4, 5)", "(-\\infty,3]\\cup(4,5)"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("\\sin^2 x + \\cos^2 x", "1"),
    ("x = 3", "3"),
    ("-2, 1", "1, -2"),
    ("2\\pi", "6.2832"),
    ("\\log_2 8", "3"),
)


def _fault(pred: str) -> None:
  """Fault injection for tests: ERPO_JAX_VERIFY_FAULT='crash:<pred>', 'hang:<pred>' or 'spin:<pred>'."""
  spec = os.environ.get("ERPO_JAX_VERIFY_FAULT", "")
  kind, _, trigger = spec.partition(":")
  if not spec or pred != trigger:
    return
  if kind == "crash":
    os._exit(13)
  if kind == "hang":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF})
    while True:
      time.sleep(3600)
  if kind == "spin":  # burns CPU with its alarm blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGPROF})
    while True:
      pass


def worker_main() -> None:
  """Reads {"id", "pred", "truth", "soft_s"} JSON lines on stdin, answers {"id", "ok", "timeout"}.

  soft_s is a budget of this process's CPU time (ITIMER_PROF), not of wall time: a verdict
  does not depend on how busy the machine is. The protocol uses a private copy of stdout;
  anything a library prints goes to stderr.
  """
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)
  for pred, truth in WARMUP_PAIRS:  # warm the parser and sympy before reporting ready
    try:
      math_verify_equivalent(pred, truth)
    except Exception:  # pylint: disable=broad-except
      pass
  signal.signal(signal.SIGPROF, _on_alarm)
  out.write('{"ready": true}\n')
  for line in sys.stdin:
    req = json.loads(line)
    _fault(req["pred"])
    ok, timed_out = False, False
    try:
      signal.setitimer(signal.ITIMER_PROF, req["soft_s"])
      try:
        ok = math_verify_equivalent(req["pred"], req["truth"])
      finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    except _SoftTimeout:
      timed_out = True
    except Exception:  # pylint: disable=broad-except
      ok = False
    out.write(json.dumps({"id": req["id"], "ok": ok, "timeout": timed_out}) + "\n")


if __name__ == "__main__":
  worker_main()

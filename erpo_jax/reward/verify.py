"""Final-answer extraction, pathological-output screening and answer equivalence.

Imports nothing heavy: `python -m erpo_jax.reward.verify` is the verifier worker that
`erpo_jax.reward.verifier.Verifier` runs in separate processes (math-verify's own
signal-based timeout is disabled there; the parent enforces the time limit).
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

# Only the tail of a response is searched: an answer sits at the end, and the cost of
# extraction stays bounded for a megabyte of text.
MAX_RESPONSE_CHARS = 65_536
MAX_ANSWER_CHARS = 512  # longer extracted answers are refused (scored wrong)
MAX_BRACE_DEPTH = 32  # deeper {...} nesting inside \boxed is refused
MAX_EXPONENT_DIGITS = 4  # x^{12345} or a power tower x^{a^{b}} is refused
_BOX_TRIES = 8  # unterminated \boxed occurrences skipped before giving up

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:\s*/\s*\d+)?")
_GSM8K_RE = re.compile(rf"\s*\$?\s*({_NUMBER})")


def _match_braces(text: str, start: int) -> str | None:
  """Contents of the {...} group opening at text[start], or None (unbalanced/too deep/too long)."""
  depth = 0
  end = min(len(text), start + MAX_ANSWER_CHARS + 2)
  for j in range(start, end):
    c = text[j]
    if c == "{":
      depth += 1
      if depth > MAX_BRACE_DEPTH:
        return None
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[start + 1:j]
  return None


def last_boxed(text: str) -> str | None:
  """Contents of the last complete `\\boxed{...}` / `\\fbox{...}` (brace-matched), or None."""
  pos = len(text)
  for _ in range(_BOX_TRIES):
    b, f = text.rfind("\\boxed", 0, pos), text.rfind("\\fbox", 0, pos)
    k = max(b, f)
    if k < 0:
      return None
    j = k + (6 if k == b else 5)
    while j < len(text) and text[j] == " ":
      j += 1
    if j < len(text) and text[j] == "{":
      inner = _match_braces(text, j)
      if inner is not None:
        return inner
    elif k == b and j > k + 6:  # "\boxed 5": the argument is the next token
      m = re.match(r"[^\s$]{1,64}", text[j:j + 65])
      if m:
        return m.group(0)
    pos = k
  return None


def _gsm8k(text: str) -> str | None:
  k = text.rfind("####")
  if k < 0:
    return None
  m = _GSM8K_RE.match(text, k + 4, k + 4 + MAX_ANSWER_CHARS)
  return m.group(1).replace(",", "") if m else None


def _last_number(text: str) -> str | None:
  last = None
  for last in _NUMBER_RE.finditer(text):
    pass
  return re.sub(r"\s+", "", last.group(0)) if last else None


def is_pathological(answer: str) -> bool:
  """True for answers that are too long, too deeply nested, or contain a huge power.

  Refused: more than MAX_ANSWER_CHARS characters, brace depth > MAX_BRACE_DEPTH, an
  exponent (`^` or `**`) that itself contains a power or a number of more than
  MAX_EXPONENT_DIGITS digits, a chained power `a^b^c`, or a factorial of such a number.
  """
  if len(answer) > MAX_ANSWER_CHARS:
    return True
  depth = 0
  for c in answer:
    depth += (c == "{") - (c == "}")
    if depth > MAX_BRACE_DEPTH:
      return True
  s = answer.replace("**", "^")
  for m in re.finditer(r"\^", s):
    j = m.end()
    while j < len(s) and s[j] == " ":
      j += 1
    if j < len(s) and s[j] == "{":
      exponent = _match_braces(s, j)
      if exponent is None:
        return True
      rest = j + len(exponent) + 2
    else:
      e = re.match(r"\(?-?\d+\)?|\\?[A-Za-z]+|.", s[j:j + 64])
      exponent = e.group(0) if e else ""
      rest = j + len(exponent)
    if "^" in exponent or re.search(rf"\d{{{MAX_EXPONENT_DIGITS + 1},}}", exponent):
      return True
    if re.match(r"\s*\^", s[rest:rest + 8]):
      return True
  return bool(re.search(rf"\d{{{MAX_EXPONENT_DIGITS + 1},}}\s*!", s))


def extract_answer(text: str, mode: str = "auto") -> str | None:
  """The final answer of a response, or None when there is none (or it is refused).

  mode: "boxed" (last \\boxed{}/\\fbox{}), "gsm8k" ("#### n"), "last_number", or "auto"
  (boxed if present, else "####", else the last number).
  """
  text = text[-MAX_RESPONSE_CHARS:]
  if mode == "boxed":
    found = last_boxed(text)
  elif mode == "gsm8k":
    found = _gsm8k(text)
  elif mode == "last_number":
    found = _last_number(text)
  elif mode == "auto":
    found = last_boxed(text)
    if found is None:
      found = _gsm8k(text)
    if found is None:
      found = _last_number(text)
  else:
    raise ValueError(f"unknown extraction mode {mode!r}")
  if found is None:
    return None
  found = found.strip()
  if not found or is_pathological(found):
    return None
  return found


# ----------------------------------------------------------------------------- normalisation

_SPACING = re.compile(r"\\[!,;:> ]|\\quad|\\qquad|~")
_UNIT = re.compile(r"^(.*?[\d}])\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?[23]\}?)?$")
_TEXT_ONLY = re.compile(r"^\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}$")
_INT = re.compile(r"^-?\d+$")
_DEC = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")


def normalize(s: str) -> str:
  """A canonical spelling of a short answer for plain string/number comparison.

  Strips $ and \\$, spacing commands, \\left/\\right, degrees, a trailing period, a
  trailing unit `\\text{cm}`, thousands separators ("1,000", "1{,}000" -> "1000") and
  whitespace; \\dfrac/\\tfrac -> \\frac and \\frac12 -> \\frac{1}{2}.
  """
  s = s.strip().replace("\\$", "").replace("$", "").replace("{,}", ",")
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
  s = re.sub(r"\s+", "", s)
  s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
  if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
    s = s.replace(",", "")
  return s


def parse_number(s: str) -> tuple[fractions.Fraction, bool] | None:
  """(value, is_percent) of a normalised plain number: 12, -0.5, 3/4, \\frac{3}{4}, 50\\%."""
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
  """Raised by SIGALRM inside the worker; a BaseException so math-verify cannot swallow it."""


def _on_alarm(signum, frame):
  raise _SoftTimeout()


def _fault(pred: str) -> None:
  """Fault injection for tests: ERPO_JAX_VERIFY_FAULT='crash:<pred>' or 'hang:<pred>'."""
  spec = os.environ.get("ERPO_JAX_VERIFY_FAULT", "")
  kind, _, trigger = spec.partition(":")
  if not spec or pred != trigger:
    return
  if kind == "crash":
    os._exit(13)
  if kind == "hang":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    while True:
      time.sleep(3600)


def worker_main() -> None:
  """Reads {"id", "pred", "truth", "soft_s"} JSON lines on stdin, answers {"id", "ok", "timeout"}.

  The protocol uses a private copy of stdout; anything a library prints goes to stderr.
  """
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)
  math_verify_equivalent("1", "1")  # warm the parser before reporting ready
  signal.signal(signal.SIGALRM, _on_alarm)
  out.write('{"ready": true}\n')
  for line in sys.stdin:
    req = json.loads(line)
    _fault(req["pred"])
    ok, timed_out = False, False
    try:
      signal.setitimer(signal.ITIMER_REAL, req["soft_s"])
      try:
        ok = math_verify_equivalent(req["pred"], req["truth"])
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
      timed_out = True
    except Exception:  # pylint: disable=broad-except
      ok = False
    out.write(json.dumps({"id": req["id"], "ok": ok, "timeout": timed_out}) + "\n")


if __name__ == "__main__":
  worker_main()

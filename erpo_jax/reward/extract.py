"""Final-answer extraction from a model's response and from a reference solution, with screening of
pathological outputs. Pure string work (regular expressions with bounded repetition), no imports of
math libraries; reward/verify.py decides equivalence."""

from __future__ import annotations

import re

# Only the tail of a response is searched: an answer sits at the end, and the cost of
# extraction stays bounded for a megabyte of text.
MAX_RESPONSE_CHARS = 65_536
MAX_ANSWER_CHARS = 512  # longer extracted answers are refused (scored wrong)
MAX_BRACE_DEPTH = 32  # deeper {...} nesting inside \boxed is refused
MAX_EXPONENT_DIGITS = 4  # x^{12345} or a power tower x^{a^{b}} is refused
_BOX_TRIES = 8  # unterminated \boxed occurrences skipped before giving up

# A number as models and data sets write it: 1,234 / 1 234 / 14{,}916 / 1\!000 (unambiguous thousands groups only,
# never "32, 349"), decimals, \frac{a}{b} / \dfrac{a}{b} / \frac12, mixed numbers 2\frac{1}{3}, a/b.
_INT_PART = r"\d{1,3}(?:(?:,| | ?\{ ?, ?\} ?|\\!|\\,)\d{3})+(?!\d)|\d+"
_FRAC_TOKEN = r"\\[dt]?frac(?:\{ ?-?\d+ ?\}\{ ?-?\d+ ?\}|\d\d)"
# Whitespace inside a number is at most one space at each place, so no pattern backtracks over a long run.
_LATEX_NUMBER = rf"(?:- ?)?(?:(?:\d+ ?)?{_FRAC_TOKEN}|(?:{_INT_PART})(?:\.\d+)?(?: ?/ ?\d+)?|\.\d+)"
# Decorations after a number that do not change it: percent, degrees, a unit word in \text{}.
_NUMBER_SUFFIX = (r"(?: ?(?:\\%|%|\^ ?\{?\\circ\}?|°|\\(?:text|mbox|mathrm)\{ ?[A-Za-z][A-Za-z .]{0,30}\}"
                  r"(?:\^\{?[23]\}?)?))?")
# The lenient fallback's number: never digits that follow a letter ("AZYUK2A", "x2") or a power sign;
# a unit glued after it ("12cm") is allowed.
_LOOSE_NUMBER_RE = re.compile(rf"(?<![A-Za-z0-9_^.\\])(?:{_LATEX_NUMBER}){_NUMBER_SUFFIX}(?![0-9_])")
_FINAL_ANSWER_RE = re.compile(r"final answer is ?:? ?", re.IGNORECASE)
_GSM8K_NUMBER_RE = re.compile(rf"(?:\\\$|\$)? ?({_LATEX_NUMBER}{_NUMBER_SUFFIX})")
_MATH_SPAN_RE = re.compile(r"\$\$(.{1,512}?)\$\$|\$(.{1,512}?)\$|\\\((.{1,512}?)\\\)|\\\[(.{1,512}?)\\\]", re.DOTALL)
_SPAN_TAIL_CHARS = 2048  # math spans are looked for in this much of the end of a response
_MAX_BOXES = 64  # boxes read from one response


def _skip_spaces(text: str, j: int) -> int:
  """The index of the first character at or after j that is not a space."""
  while j < len(text) and text[j] == " ":
    j += 1
  return j


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
    j = _skip_spaces(text, k + (6 if k == b else 5))
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


def all_boxed(text: str) -> list[str]:
  """Contents of every complete `\\boxed{...}` / `\\fbox{...}` in order (at most _MAX_BOXES, the last ones)."""
  found = []
  for m in re.finditer(r"\\(?:boxed|fbox)", text):
    j = _skip_spaces(text, m.end())
    if j < len(text) and text[j] == "{":
      inner = _match_braces(text, j)
      if inner is not None:
        found.append(inner)
    elif m.group(0) == "\\boxed" and j > m.end():
      t = re.match(r"[^\s$]{1,64}", text[j:j + 65])
      if t:
        found.append(t.group(0))
  return found[-_MAX_BOXES:]


def split_top_level(s: str) -> list[str]:
  """Parts of s split at commas and semicolons outside (), [], {} and \\{ \\}; thousands groups kept."""
  s = re.sub(r"(?<=\d)\s*\{\s*,\s*\}\s*(?=\d{3})", "", s)
  if re.fullmatch(r"\s*-?\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*", s):
    return [s]
  parts, depth, start = [], 0, 0
  for j, c in enumerate(s):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c in ",;" and depth == 0:
      parts.append(s[start:j])
      start = j + 1
  parts.append(s[start:])
  return [p.strip() for p in parts if p.strip()]


def has_several_elements(gold: str) -> bool:
  """Whether a ground truth lists several answers ("1, -2", "6 \\text{ and } 8"), not one number."""
  g = gold.strip().strip("$").strip()
  for left, right in (("\\{", "\\}"), ("{", "}")):  # a set: its elements
    if g.startswith(left) and g.endswith(right):
      g = g[len(left):-len(right)]
      break
  return len(split_top_level(g)) > 1 or bool(re.search(r"\\text\{\s*(?:and|or)\s*\}", g))


def _gsm8k(text: str) -> str | None:
  """The answer after the last "####": a number (LaTeX spellings too) or, if none leads the line, the line."""
  k = text.rfind("####")
  if k < 0:
    return None
  line = text[k + 4:k + 4 + MAX_ANSWER_CHARS].split("\n", 1)[0].strip()
  m = _GSM8K_NUMBER_RE.match(line)
  if m:
    rest = line[m.end():].strip()
    if not rest or re.fullmatch(r"[.!]|[A-Za-z][A-Za-z .]*", rest):  # "72", "72.", "72 apples"
      return m.group(1)
  line = line.rstrip(".").strip()
  return line or None


def _final_answer(text: str) -> tuple[int, str] | None:
  """(position, answer) after the last "final answer is" (Minerva's "Final Answer: The final answer is $X$")."""
  last = None
  for last in _FINAL_ANSWER_RE.finditer(text):
    pass
  if last is None:
    return None
  rest = text[last.end():last.end() + MAX_ANSWER_CHARS]
  span = _MATH_SPAN_RE.match(rest)
  if span:
    inner = next(g for g in span.groups() if g is not None).strip()
    return (last.start(), inner) if inner else None
  m = _GSM8K_NUMBER_RE.match(rest)
  return (last.start(), m.group(1)) if m else None


def _last_number(text: str) -> str | None:
  """The last standalone number, or the last $...$ / \\(...\\) / \\[...\\] span if it ends later."""
  last = None
  for last in _LOOSE_NUMBER_RE.finditer(text):
    pass
  span, offset = None, max(0, len(text) - _SPAN_TAIL_CHARS)
  for span in _MATH_SPAN_RE.finditer(text, offset):
    pass
  if span is not None and (last is None or span.end() >= last.end()):
    inner = next(g for g in span.groups() if g is not None).strip()
    if inner and len(inner) <= MAX_ANSWER_CHARS:
      return inner
  return last.group(0).strip() if last else None


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
    j = _skip_spaces(s, m.end())
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


def gold_answer(text: str) -> str:
  """The answer a reference solution or ground-truth string states.

  Its boxed answers (several distinct ones joined: "\\boxed{1} and \\boxed{-2}" -> "1, -2"),
  else the answer after "####", else the text without its math delimiters ("$[0,1)$" -> "[0,1)").
  """
  boxes = list(dict.fromkeys(b.strip() for b in all_boxed(text) if b.strip()))
  if boxes:
    return ", ".join(boxes)
  if "####" in text:
    found = _gsm8k(text)
    if found:
      return found.strip()
  s = text.strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if s.startswith(left) and s.endswith(right) and len(s) > len(left) + len(right):
      inner = s[len(left):-len(right)]
      if left != "$" or "$" not in inner:
        return inner.strip()
  return s


def extract_answer(text: str, mode: str = "auto", gold: str | None = None) -> str | None:
  """The final answer of a response, or None when there is none (or it is refused).

  mode "boxed" (strict, the paper's setting): the last \\boxed{}/\\fbox{} only.
  "gsm8k": the number (or line) after the last "####".
  "last_number": the last standalone number, or the last inline-math span if it ends later;
  digits inside a word ("AZYUK2A", "x2") are never a number.
  "auto" (lenient): boxed if present (an unboxed "final answer is X" after the last box wins),
  else "####", else as last_number.
  When `gold` lists several answers ("1, -2") and the response boxes several distinct ones
  (`\\boxed{-2} and \\boxed{1}`), all its boxes are joined, as math-verify does: "-2, 1". Boxing
  extra candidates does not pay: the joined set must equal the gold's.
  """
  text = text[-MAX_RESPONSE_CHARS:]
  if mode == "data":  # reward.extract=data not resolved against a data source (library use): lenient
    mode = "auto"
  if mode not in ("boxed", "gsm8k", "last_number", "auto"):
    raise ValueError(f"unknown extraction mode {mode!r}")
  found = None
  if mode in ("boxed", "auto"):
    found = last_boxed(text)
    if found is not None and gold is not None and has_several_elements(gold):
      boxes = list(dict.fromkeys(b.strip() for b in all_boxed(text) if b.strip()))
      if len(boxes) > 1:
        found = ", ".join(boxes)
  if mode == "auto":
    final = _final_answer(text)
    if final is not None and (found is None or final[0] > max(text.rfind("\\boxed"), text.rfind("\\fbox"))):
      found = final[1]
  if found is None and mode in ("gsm8k", "auto"):
    found = _gsm8k(text)
  if found is None and mode in ("last_number", "auto"):
    found = _last_number(text)
  if found is None:
    return None
  found = found.strip()
  if not found or is_pathological(found):
    return None
  return found


# ----------------------------------------------------------------------------- normalisation

"""Row shapes users already have (verl, TRL, GSM8K, MATH, named columns) -> prompt, answer, level.

    verl   : prompt = [{role, content}, ...], reward_model = {ground_truth}
    trl    : prompt (text or chat list), solution (the last \\boxed{} if it has one, else all of it)
    gsm8k  : question, answer = "...#### 1,042"         -> "1042" (lists and LaTeX kept as written)
    math   : problem, solution = "...\\boxed{\\frac12}"  -> "\\frac12" (an `answer` column wins), level "Level 3" -> 3
    columns: data.prompt_column, data.answer_column

`check_untrusted` refuses rows that should not be trusted whatever their shape: a non-finite ground
truth, a chat role outside data.chat_roles, a chat-template control token in any text.
"""

from __future__ import annotations

import math
import re
from typing import Any

from erpo_jax.reward.extract import last_boxed

SHAPES = ("verl", "trl", "gsm8k", "math", "columns")

# Default (prompt column, answer column) of each shape.
_COLUMNS = {"verl": ("prompt", "reward_model"), "trl": ("prompt", "solution"), "gsm8k": ("question", "answer"),
            "math": ("problem", "solution")}


class RowError(Exception):
  """A malformed row: carries the offending field."""

  def __init__(self, field: str, message: str):
    super().__init__(f"field '{field}': {message}")
    self.field = field
    self.message = message


def detect_shape(columns, prompt_column: str = "", answer_column: str = "") -> str | None:
  """The shape whose columns a row (or a parquet schema) has, or None."""
  cols = set(columns)
  if "reward_model" in cols and "prompt" in cols:
    return "verl"
  if "problem" in cols and ("solution" in cols or "answer" in cols):
    return "math"
  if "question" in cols and "answer" in cols:
    return "gsm8k"
  if "prompt" in cols and "solution" in cols:
    return "trl"
  if prompt_column and answer_column and {prompt_column, answer_column} <= cols:
    return "columns"
  return None


def _type_name(v: Any) -> str:
  return {dict: "object", list: "list", tuple: "list", type(None): "null", bool: "boolean"}.get(
      type(v), type(v).__name__)


def _prompt(row: dict, field: str) -> str | tuple[tuple[str, str], ...]:
  if field not in row:
    raise RowError(field, "missing")
  v = row[field]
  if isinstance(v, str):
    if not v.strip():
      raise RowError(field, "empty prompt")
    return v
  if isinstance(v, (list, tuple)) and v:
    messages = []
    for k, m in enumerate(v):
      if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
        raise RowError(f"{field}[{k}]", f"expected a {{role, content}} message of strings, got {_type_name(m)}")
      messages.append((m["role"], m["content"]))
    if not any(c.strip() for r, c in messages if r == "user"):
      raise RowError(field, "empty prompt (no user message with content)")
    return tuple(messages)
  raise RowError(field, f"expected a non-empty string or a list of {{role, content}} messages, got {_type_name(v)}")


def _answer(row: dict, field: str, name: str = "") -> str:
  """The answer in row[field] as text; errors name the field as `name` (default: field)."""
  name = name or field
  if field not in row:
    raise RowError(name, "missing")
  v = row[field]
  if isinstance(v, bool) or not isinstance(v, (str, int, float)):
    raise RowError(name, f"expected a string or number, got {_type_name(v)}")
  s = v.strip() if isinstance(v, str) else str(v)
  if not s:
    raise RowError(name, "empty answer")
  return s


def _level(v: Any) -> int | None:
  if isinstance(v, int) and not isinstance(v, bool):
    return v
  if isinstance(v, str):
    m = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", v, flags=re.IGNORECASE)
    return int(m.group(1)) if m else None
  return None


def _gsm8k_gold(answer: str) -> str:
  """GSM8K's own reading of "#### 1,000" (separators dropped) where the thousands groups are unambiguous.

  "14{,}916" -> "14916"; a list such as "32, 349" or a LaTeX answer is kept as written.
  """
  plain = re.sub(r"(?<=\d)(?:,|\{,\})(?=\d{3}(?!\d))", "", answer)
  return plain if re.fullmatch(r"-?\$?\d+(?:\.\d+)?", plain) else answer


def parse_row(row: dict, shape: str, prompt_column: str = "", answer_column: str = ""
              ) -> tuple[str | tuple[tuple[str, str], ...], str, int | None]:
  """(prompt, ground-truth answer, level) of one row; raises RowError naming the bad field."""
  if shape == "columns":
    pcol, acol = prompt_column, answer_column
  else:
    pcol, acol = _COLUMNS[shape]
    pcol, acol = prompt_column or pcol, answer_column or acol
  try:
    return _parse(row, shape, pcol, acol, bool(answer_column))
  except RowError as e:
    if e.message == "missing":
      answer = f"{acol}.ground_truth" if shape == "verl" and not answer_column else acol
      raise RowError(e.field, f"missing ({shape} rows have '{pcol}' and '{answer}')") from None
    raise


def _parse(row: dict, shape: str, pcol: str, acol: str, answer_as_is: bool):
  prompt = _prompt(row, pcol)
  level = _level(row.get("level"))
  if answer_as_is or shape == "columns":  # an answer column named by the user is taken as it is
    return prompt, _answer(row, acol), level
  if shape == "verl":
    rm = row.get(acol)
    if not isinstance(rm, dict):
      raise RowError(acol, "missing" if rm is None else f"expected an object with ground_truth, got {_type_name(rm)}")
    return prompt, _answer(rm, "ground_truth", f"{acol}.ground_truth"), level
  if shape == "gsm8k":
    text = _answer(row, acol)
    m = re.search(r"####\s*(.+?)\s*$", text)
    if not m:
      raise RowError(acol, "expected a GSM8K solution ending in '#### <answer>'")
    return prompt, _gsm8k_gold(m.group(1)), level
  if shape == "math" and "answer" in row and row["answer"] is not None:
    return prompt, _answer(row, "answer"), level
  text = _answer(row, acol)
  boxed = last_boxed(text)
  if shape == "math":
    if boxed is None or not boxed.strip():
      raise RowError(acol, "expected a solution with a \\boxed{...} answer")
    return prompt, boxed.strip(), level
  return prompt, (boxed.strip() if boxed and boxed.strip() else text), level  # trl


# Chat-template control tokens (ChatML, Llama 2/3, Gemma, and any `<|...|>` token): a data row holding one
# could open a turn of its own in the rendered prompt.
_CONTROL_TOKEN = re.compile(r"<\|[^<>|\s]{1,64}\|>|</?s>|\[/?INST\]|<</?SYS>>|<(?:start|end)_of_turn>")


CHAT_ROLES = ("system", "user", "assistant")


def check_untrusted(prompt, answer: str, roles=CHAT_ROLES) -> None:
  """Raises RowError for a non-finite ground truth, a chat role outside `roles`, or a control token in a role,
  a message or the question."""
  try:
    number = float(answer.strip().replace(",", ""))
  except ValueError:
    number = 0.0
  if not math.isfinite(number):
    raise RowError("answer", f"ground truth {answer.strip()[:40]!r} is not a finite number")
  turns = [("user", prompt)] if isinstance(prompt, str) else list(prompt)
  for k, (role, content) in enumerate(turns):
    field = "prompt" if isinstance(prompt, str) else f"prompt[{k}]"
    if role not in roles:
      raise RowError(f"{field}.role", f"role {role[:40]!r} is not one of {', '.join(roles)} (data.chat_roles)")
    m = _CONTROL_TOKEN.search(content)
    if m:
      raise RowError(field, f"contains the chat-template control token {m.group(0)!r}")

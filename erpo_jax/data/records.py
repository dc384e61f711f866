"""A problem as every source yields it: prompt (text or chat messages), ground-truth answer, origin."""

from __future__ import annotations

import dataclasses

BUILTIN_ARITHMETIC = "builtin:arithmetic"


@dataclasses.dataclass(frozen=True)
class Record:
  id: str  # unique within its source
  prompt: str | tuple[tuple[str, str], ...]  # a question, or chat messages ((role, content), ...)
  answer: str  # ground truth
  source: str  # file path or "builtin:arithmetic"
  level: int | None = None  # difficulty, where the data has one

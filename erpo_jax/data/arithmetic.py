"""builtin:arithmetic: a seeded procedural set of arithmetic problems with exact integer answers.

Levels (a weak 135M model solves most of level 1 and little of 4-5):
  1  addition / subtraction of digits 1..9   "What is 7+5?"
  2  two-digit addition / subtraction        "Compute 48 - 19."
  3  times tables up to 12x12, or a two-step expression with precedence   "What is 3 + 4 * 6?"
  4  one- or two-step word problems          "A box holds 6 pencils. How many pencils are in 7 boxes?"
  5  multi-step expressions with parentheses "What is (12 + 7) * 3 - 4 * (5 - 2)?"
Problem i has level levels[i % len(levels)]. The stream of a seed is fixed; texts
already drawn (or listed in `exclude`) are redrawn, so a split never repeats a
problem of `exclude` (the eval split excludes the training split).
"""

from __future__ import annotations

import logging
import random

from erpo_jax.data.records import BUILTIN_ARITHMETIC, Record

log = logging.getLogger(__name__)

_UNIQUE_TRIES = 64  # redraws to avoid a duplicate within the split (then a duplicate is allowed)
_EXCLUDE_TRIES = 512  # redraws to avoid an excluded text (then the slot moves to another level)

# Ten phrasings per operation keep level 1 (81 sums and 45 differences of digits 1..9) from
# running out of distinct texts before both splits are drawn.
_ADD = ("What is {a}+{b}?", "What is {a} + {b}?", "Compute {a} + {b}.", "What is {a} plus {b}?", "Add {a} and {b}.",
        "Calculate {a} + {b}.", "What is the sum of {a} and {b}?", "{a} + {b} = ?", "Find {a} + {b}.",
        "How much is {a} plus {b}?")
_SUB = ("What is {a}-{b}?", "What is {a} - {b}?", "Compute {a} - {b}.", "What is {a} minus {b}?",
        "Subtract {b} from {a}.", "Calculate {a} - {b}.", "What is the difference between {a} and {b}?",
        "{a} - {b} = ?", "Find {a} - {b}.", "How much is {a} minus {b}?")
_MUL = ("What is {a}*{b}?", "What is {a} * {b}?", "Compute {a} * {b}.", "What is {a} times {b}?",
        "Multiply {a} by {b}.", "Calculate {a} * {b}.", "What is the product of {a} and {b}?", "{a} * {b} = ?",
        "Find {a} * {b}.", "How much is {a} times {b}?")
_NAMES = ("Tom", "Anna", "Ravi", "Mia", "Lena", "Omar", "Sara", "Ben", "Yuki", "Leo")
_ITEMS = ("apples", "marbles", "stickers", "coins", "books", "shells")


def _add_or_subtract(rng: random.Random, lo: int, hi: int) -> tuple[str, int]:
  """a + b or a - b (a >= b, never negative) with a, b in [lo, hi]."""
  a, b = rng.randint(lo, hi), rng.randint(lo, hi)
  if rng.random() < 0.5:
    return rng.choice(_ADD).format(a=a, b=b), a + b
  a, b = max(a, b), min(a, b)
  return rng.choice(_SUB).format(a=a, b=b), a - b


def _level1(rng: random.Random) -> tuple[str, int]:
  return _add_or_subtract(rng, 1, 9)


def _level2(rng: random.Random) -> tuple[str, int]:
  return _add_or_subtract(rng, 10, 99)


def _level3(rng: random.Random) -> tuple[str, int]:
  if rng.random() < 0.5:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return rng.choice(_MUL).format(a=a, b=b), a * b
  a, b, c = rng.randint(1, 20), rng.randint(2, 9), rng.randint(2, 9)
  if rng.random() < 0.5:
    return f"What is {a} + {b} * {c}?", a + b * c
  return f"What is {b} * {c} - {a}?", b * c - a


def _level4(rng: random.Random) -> tuple[str, int]:
  name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
  kind = rng.randrange(5)
  if kind == 0:
    a, b = rng.randint(5, 30), rng.randint(2, 20)
    c = rng.randint(1, a + b)
    return (f"{name} has {a} {item}. {name} gets {b} more and then gives away {c}. "
            f"How many {item} does {name} have now?"), a + b - c
  if kind == 1:
    a, b = rng.randint(3, 12), rng.randint(2, 9)
    return f"A box holds {a} {item}. How many {item} are in {b} boxes?", a * b
  if kind == 2:
    a, b = rng.randint(5, 25), rng.randint(2, 7)
    return f"{name} reads {a} pages every day. How many pages does {name} read in {b} days?", a * b
  if kind == 3:
    b, k = rng.randint(2, 9), rng.randint(2, 12)
    return (f"{b * k} {item} are shared equally among {b} children. "
            f"How many {item} does each child get?"), k
  a, b = rng.randint(2, 9), rng.randint(2, 6)
  c = rng.choice([x for x in (10, 20, 50, 100) if x >= a * b])
  return (f"A pen costs {a} dollars. {name} buys {b} pens and pays with a {c}-dollar bill. "
          f"How many dollars of change does {name} get?"), c - a * b


def _level5(rng: random.Random) -> tuple[str, int]:
  a, b, c, d, e = (rng.randint(2, 15) for _ in range(5))
  kind = rng.randrange(4)
  if kind == 0:
    return f"What is ({a} + {b}) * {c} - {d}?", (a + b) * c - d
  if kind == 1:
    return f"What is {a} * ({b} - {c}) + {d}?", a * (b - c) + d
  if kind == 2:
    return f"What is ({a} - {b}) * ({c} + {d})?", (a - b) * (c + d)
  return f"What is ({a} + {b}) * {c} - {d} * ({e} - {b})?", (a + b) * c - d * (e - b)


_GENERATORS = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def generate(size: int, levels: tuple[int, ...], seed: int, exclude: frozenset[str] = frozenset()) -> list[Record]:
  """`size` problems cycling through `levels`, deterministic in `seed`, none of whose texts is in `exclude`.

  If a level runs out of new texts, its slot goes to the next level; if all run out
  the split is shorter than `size` (a warning says so).
  """
  rng = random.Random(seed)
  seen: set[str] = set()
  records: list[Record] = []
  exhausted: set[int] = set()
  for i in range(size):
    order = [levels[(i + k) % len(levels)] for k in range(len(levels))]
    for level in (l for l in order if l not in exhausted):
      fallback = None
      for attempt in range(_EXCLUDE_TRIES):
        text, answer = _GENERATORS[level](rng)
        if text in exclude:
          continue
        if text not in seen or attempt >= _UNIQUE_TRIES:
          break
        fallback = fallback or (text, answer)
      else:
        if fallback is None:
          exhausted.add(level)
          continue
        text, answer = fallback
      seen.add(text)
      records.append(Record(id=f"arithmetic-{seed}-{i}", prompt=text, answer=str(answer),
                            source=BUILTIN_ARITHMETIC, level=level))
      break
  if len(records) < size:
    log.warning("%s: only %d of %d problems (seed %d) avoid the excluded split", BUILTIN_ARITHMETIC,
                len(records), size, seed)
  return records

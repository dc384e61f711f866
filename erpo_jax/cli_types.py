"""argparse value types of the command line: each bad value is one line naming what was expected."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
  try:
    v = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if v < 1:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
  return v


def positive_float(text: str) -> float:
  try:
    v = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
  if not 0 < v < float("inf"):
    raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text!r}")
  return v


def step_variants(text: str) -> str:
  letters = text.replace(",", "")
  if not letters or any(c not in "abcde" for c in letters):
    raise argparse.ArgumentTypeError(f"expected letters of abcde (e.g. c or c,e), got {text!r}")
  return "".join(sorted(set(letters)))


def temperature(text: str) -> float:
  try:
    v = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
  if not 0 <= v < float("inf"):
    raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), got {text!r}")
  return v

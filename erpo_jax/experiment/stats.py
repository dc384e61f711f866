"""Pure statistics of the ablation report: mean and spread over seeds, temperature bands, correlations, series.

No model, no files, no plotting: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

LOW_BAND = "low"  # temperatures < 1.0
HIGH_BAND = "high"  # temperatures >= 1.2
LOW_BELOW = 1.0
HIGH_FROM = 1.2


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
  """(mean, sample standard deviation with ddof=1) of the values over seeds; spread 0 for one value.

  NaN values (a seed without the number) are left out; no values gives (nan, nan).
  """
  x = np.asarray([v for v in values if v is not None and not math.isnan(v)], np.float64)
  if x.size == 0:
    return math.nan, math.nan
  return float(x.mean()), float(x.std(ddof=1)) if x.size > 1 else 0.0


def band_of(temperature: float) -> str | None:
  """'low' below 1.0, 'high' from 1.2, None in between."""
  if temperature < LOW_BELOW:
    return LOW_BAND
  if temperature >= HIGH_FROM:
    return HIGH_BAND
  return None


def band_means(by_temperature: dict[float, float]) -> dict[str, float]:
  """{'low': mean over temperatures < 1.0, 'high': mean over temperatures >= 1.2}; nan for an empty band."""
  out = {}
  for band in (LOW_BAND, HIGH_BAND):
    vals = [v for t, v in by_temperature.items() if band_of(t) == band]
    out[band] = float(np.mean(vals)) if vals else math.nan
  return out


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
  """Pearson's r of paired samples; nan when fewer than 2 points or a variable is constant."""
  a, b = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if a.shape != b.shape or a.ndim != 1:
    raise ValueError(f"expected two 1-D sequences of one length, got shapes {a.shape} and {b.shape}")
  if a.size < 2:
    return math.nan
  da, db = a - a.mean(), b - b.mean()
  denom = math.sqrt(float(np.dot(da, da)) * float(np.dot(db, db)))
  return float(np.dot(da, db) / denom) if denom > 0 else math.nan


def ranks(x: Sequence[float]) -> np.ndarray:
  """Ranks 1..n, tied values sharing the mean of their ranks (as scipy.stats.rankdata 'average')."""
  a = np.asarray(x, np.float64)
  order = np.argsort(a, kind="stable")
  sorted_a = a[order]
  r = np.empty(a.size, np.float64)
  i = 0
  while i < a.size:
    j = i
    while j + 1 < a.size and sorted_a[j + 1] == sorted_a[i]:
      j += 1
    r[order[i:j + 1]] = (i + j) / 2 + 1
    i = j + 1
  return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
  """Spearman's rho: Pearson's r of the ranks (ties averaged)."""
  return pearson(ranks(x), ranks(y))


def final_value(rows: list[dict], key: str, window: int) -> float:
  """Mean of `key` over the rows of the last `window` steps (of the run's last logged step) that have it.

  A metric logged only every few steps (Policy-KL with a cached reference) may have
  no row in that window: then its last logged value. nan when no row has it.
  """
  have = [r for r in rows if key in r and r[key] is not None]
  if not have:
    return math.nan
  last_step = max(r["step"] for r in rows)
  recent = [float(r[key]) for r in have if r["step"] > last_step - window]
  return float(np.mean(recent)) if recent else float(have[-1][key])


def step_series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the rows that have `key`, by step."""
  pairs = sorted((int(r["step"]), float(r[key])) for r in rows if key in r and r[key] is not None)
  return [s for s, _ in pairs], [v for _, v in pairs]


def mean_over_seeds(series: list[tuple[list[int], list[float]]]) -> tuple[list[int], list[float]]:
  """Per step, the mean over the seeds' series that have that step (steps where any seed logged the metric)."""
  acc: dict[int, list[float]] = {}
  for steps, values in series:
    for s, v in zip(steps, values):
      acc.setdefault(s, []).append(v)
  steps = sorted(acc)
  return steps, [float(np.mean(acc[s])) for s in steps]


def moving_average(values: Sequence[float], window: int) -> list[float]:
  """Trailing mean over up to `window` values (the first points average what precedes them)."""
  x = np.asarray(values, np.float64)
  c = np.concatenate([[0.0], np.cumsum(x)])
  i = np.arange(1, x.size + 1)
  lo = np.maximum(i - window, 0)
  return ((c[i] - c[lo]) / (i - lo)).tolist()

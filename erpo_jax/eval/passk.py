"""Pure evaluation math and reports: Pass@k (unbiased, Codex paper), Avg@k, set summaries, scalars, table.

Dimension letters: P problems, K samples per problem.

For a problem with n samples of which c are correct, the unbiased estimate of
the chance that at least one of k samples drawn without replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

(Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), which is
1 when n - c < k. Avg@k is the mean accuracy of the k samples, c / k.

Pass@1 is the paper's single-sample accuracy: each problem gets one attempt,
its first sample, and passes if that one is correct. It estimates the same
probability as Avg@k but from one sample per problem instead of k, so it is
reported apart from Avg@k and is noisier (k times the variance); at
temperature 0 every sample is the greedy answer and all three coincide.
"""

from __future__ import annotations

import numpy as np

METRICS = ("avg@{k}", "pass@{k}", "pass@1", "response_len", "truncated")  # the numbers of one result row
MEAN = "mean"  # key of averaged rows (no set label takes it)


def metric_names(k: int) -> tuple[str, ...]:
  return tuple(m.format(k=k) for m in METRICS)


def temperature_key(t: float) -> str:
  """Key of a temperature in results and tags: 0.5 -> 't0.5', 0 -> 't0.0'."""
  return f"t{float(t)}"


def pass_at_k(n, c, k: int) -> np.ndarray:
  """1 - C(n - c, k) / C(n, k) per problem, for arrays (or scalars) n_P, c_P and one k <= min(n).

  Computed as 1 - exp(sum_{i=n-c+1}^{n} log1p(-k / i)): no binomials, so no overflow
  for large n, and exact to rounding. A problem with n - c < k scores exactly 1.
  """
  n_P = np.asarray(n, np.int64)
  c_P = np.asarray(c, np.int64)
  n_P, c_P = np.broadcast_arrays(n_P, c_P)
  if k < 1:
    raise ValueError(f"k: expected an integer >= 1, got {k}")
  if np.any(c_P < 0) or np.any(c_P > n_P):
    raise ValueError(f"expected 0 <= c <= n, got n={n_P.tolist()}, c={c_P.tolist()}")
  if np.any(n_P < k):
    raise ValueError(f"expected n >= k={k} samples per problem, got n={n_P.tolist()}")
  all_hit_P = n_P - c_P < k
  if n_P.size == 0:
    return np.zeros(n_P.shape, np.float64)
  # Terms i in (n - c, n]; where n - c < k some terms would be <= 0, but those rows score 1.
  i_I = np.arange(1, int(n_P.max()) + 1, dtype=np.float64)
  in_prod_PxI = (i_I > (n_P - c_P)[..., None]) & (i_I <= n_P[..., None])
  with np.errstate(divide="ignore", invalid="ignore"):
    log_terms_I = np.log1p(-k / i_I)
  log_miss_P = np.sum(np.where(in_prod_PxI & ~all_hit_P[..., None], log_terms_I, 0.0), axis=-1)
  return np.where(all_hit_P, 1.0, -np.expm1(log_miss_P))


def avg_at_k(correct_PxK) -> np.ndarray:
  """Per-problem mean accuracy c_P / K of the K samples (its mean over problems is the set's Avg@k)."""
  correct_PxK = np.asarray(correct_PxK, bool)
  return correct_PxK.sum(axis=-1) / correct_PxK.shape[-1]


def set_scores(correct_PxK, k: int) -> dict[str, float]:
  """Avg@k, Pass@k and Pass@1 of one set (means over its P problems), keyed 'avg@k', 'pass@k', 'pass@1'.

  correct_PxK holds K = k samples per problem, in sampling order; Pass@1 is the
  accuracy of each problem's first sample (module docstring).
  """
  correct_PxK = np.asarray(correct_PxK, bool)
  P, K = correct_PxK.shape
  if K != k:
    raise ValueError(f"expected k={k} samples per problem, got {K}")
  if P == 0:
    raise ValueError("expected at least one problem")
  n_P = np.full((P,), K)
  c_P = correct_PxK.sum(axis=-1)
  return {f"avg@{k}": float(np.sum(c_P) / (P * K)),
          f"pass@{k}": float(np.sum(pass_at_k(n_P, c_P, k)) / P),
          "pass@1": float(np.mean(correct_PxK[:, 0]))}


def mean_of(rows: list[dict], keys) -> dict[str, float]:
  """Unweighted mean of each of `keys` over result rows (over temperatures, or over sets: a macro average)."""
  if not rows:
    raise ValueError("expected at least one row to average")
  return {key: float(sum(r[key] for r in rows) / len(rows)) for key in keys}


def scalars(results: dict, prefix: str = "eval") -> dict[str, float]:
  """Flat TensorBoard scalars: <prefix>/<set>/t<temp>/<metric>, <prefix>/<set>/<metric> (mean over
  temperatures), <prefix>/mean/t<temp>/<metric> (mean over sets) and <prefix>/mean/<metric>."""
  names = metric_names(results["k"])
  out = {}
  groups = dict(results["sets"])
  groups[MEAN] = results[MEAN]
  for label, g in groups.items():
    for tk, row in g["by_temperature"].items():
      out.update({f"{prefix}/{label}/{tk}/{m}": float(row[m]) for m in names})
    out.update({f"{prefix}/{label}/{m}": float(g[MEAN][m]) for m in names})
  return out


def format_table(results: dict) -> str:
  """Sets x temperatures, each cell 'Avg@k / Pass@k' in percent; a mean column and a mean row."""
  k = results["k"]
  avg, pas = f"avg@{k}", f"pass@{k}"
  tks = [temperature_key(t) for t in results["temperatures"]]
  rows = [(label, [s["by_temperature"][tk] for tk in tks] + [s[MEAN]]) for label, s in results["sets"].items()]
  if len(rows) > 1:
    rows.append((MEAN, [results[MEAN]["by_temperature"][tk] for tk in tks] + [results[MEAN][MEAN]]))
  head = [f"T={t:g}" for t in results["temperatures"]] + [MEAN]
  width0 = max(len("set"), *(len(r[0]) for r in rows))
  cell = lambda r: f"{100 * r[avg]:5.1f} / {100 * r[pas]:5.1f}"
  width = max(len(cell({avg: 1.0, pas: 1.0})), *(len(h) for h in head))
  lines = [f"Avg@{k} / Pass@{k} (%), max_new_tokens={results['max_new_tokens']}, seed={results['seed']}",
           "set".ljust(width0) + "  " + "  ".join(h.rjust(width) for h in head)]
  for label, cells in rows:
    lines.append(label.ljust(width0) + "  " + "  ".join(cell(c).rjust(width) for c in cells))
  return "\n".join(lines)


def closest_temperature(temperatures, target: float) -> float:
  """The first of `temperatures` nearest to `target` (target itself when the list is empty)."""
  if not temperatures:
    return float(target)
  return float(min(temperatures, key=lambda t: abs(t - target)))

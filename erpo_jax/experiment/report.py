"""The ablation report's numbers and markdown: per-run summaries, per-variant tables, plotted series.

Pure: takes what the runs left (metrics rows, eval results, analyses) as data and
returns dicts and text; reading files and drawing are elsewhere (runner.py, plots.py).
"""

from __future__ import annotations

import dataclasses
import math

from erpo_jax.eval.passk import MEAN, closest_temperature, temperature_key
from erpo_jax.experiment import stats

# Step plots: (file stem, metric in metrics.jsonl, title, y label).
STEP_PLOTS = (
    ("reward", "reward/mean", "training reward", "mean reward per step"),
    ("kl_query", "kl/query", "Query-KL (prompt tokens)", "k3 KL to the reference"),
    ("kl_policy", "kl/policy", "Policy-KL (response tokens)", "k3 KL to the reference"),
    ("entropy", "entropy/mean", "response entropy", "nats per token"),
    ("response_len", "response/len_mean", "response length", "tokens"),
)
BASE = "untrained"  # label of the untrained model in tables and plots


@dataclasses.dataclass(frozen=True)
class RunData:
  """What one run of the grid left: its metrics rows, eval results and analysis (None when missing)."""

  variant: str
  seed: int
  rows: list[dict]
  eval: dict | None = None
  analyze: dict | None = None


def eval_by_temperature(results: dict, metric: str) -> dict[float, float]:
  """{temperature: metric} of an eval result, averaged over its sets (the results' 'mean' rows)."""
  per_t = results[MEAN]["by_temperature"]
  return {float(t): float(per_t[temperature_key(t)][metric]) for t in results["temperatures"]}


def eval_summary(results: dict) -> dict[str, float]:
  """avg/pass per temperature ('avg@T=0.5'), their mean over the sweep and the low/high band means."""
  k = results["k"]
  out = {}
  for short, metric in (("avg", f"avg@{k}"), ("pass", f"pass@{k}")):
    by_t = eval_by_temperature(results, metric)
    out.update({f"{short}@T={t:g}": v for t, v in by_t.items()})
    out[f"{short}/mean"] = float(sum(by_t.values()) / len(by_t))
    for band, v in stats.band_means(by_t).items():
      out[f"{short}/{band}"] = v
  return out


def run_summary(run: RunData, *, train_temperature: float, window: int) -> dict[str, float]:
  """One run's numbers: final train reward/accuracy, KLs and entropy; eval summary and train/eval gap."""
  out = {"train_reward": stats.final_value(run.rows, "reward/mean", window),
         "train_accuracy": stats.final_value(run.rows, "reward/accuracy", window),
         "kl_query": stats.final_value(run.rows, "kl/query", window),
         "kl_policy": stats.final_value(run.rows, "kl/policy", window),
         "entropy": stats.final_value(run.rows, "entropy/mean", window)}
  out["kl_ratio"] = out["kl_query"] / out["kl_policy"] if out["kl_policy"] > 0 else math.nan
  if run.eval is not None:
    out.update(eval_summary(run.eval))
    t = closest_temperature(run.eval["temperatures"], train_temperature)
    out["eval_at_train_t"] = eval_by_temperature(run.eval, f"avg@{run.eval['k']}")[t]
    out["gap"] = out["train_accuracy"] - out["eval_at_train_t"]
  if run.analyze is not None:
    out["pearson"], out["spearman"] = run.analyze["pearson"], run.analyze["spearman"]
  return out


def variant_table(runs: list[RunData], variants: list[str], **kw) -> dict[str, dict[str, tuple[float, float, int]]]:
  """{variant: {number: (mean, spread, seeds)}} over each variant's runs (spread: std over seeds, ddof=1)."""
  table = {}
  for v in variants:
    summaries = [run_summary(r, **kw) for r in runs if r.variant == v]
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    table[v] = {k: (*stats.mean_spread([s.get(k, math.nan) for s in summaries]),
                    sum(not math.isnan(s.get(k, math.nan)) for s in summaries)) for k in keys}
  return table


def step_series(runs: list[RunData], variants: list[str], key: str, smooth: int = 1):
  """{variant: (steps, mean over seeds per step, smoothed)} of a metrics.jsonl key (variants without it left out)."""
  out = {}
  for v in variants:
    steps, values = stats.mean_over_seeds([stats.step_series(r.rows, key) for r in runs if r.variant == v])
    if steps:
      out[v] = (steps, stats.moving_average(values, smooth) if smooth > 1 else values)
  return out


def temperature_series(runs: list[RunData], variants: list[str], base: dict | None = None) -> dict:
  """{label: {"x": temperatures, "avg": [...], "pass": [...]}}: the untrained model, each variant's mean over seeds."""
  out = {}
  if base is not None:
    k = base["k"]
    out[BASE] = {"x": [float(t) for t in base["temperatures"]],
                 "avg": list(eval_by_temperature(base, f"avg@{k}").values()),
                 "pass": list(eval_by_temperature(base, f"pass@{k}").values())}
  for v in variants:
    evals = [r.eval for r in runs if r.variant == v and r.eval is not None]
    if not evals:
      continue
    k, temps = evals[0]["k"], [float(t) for t in evals[0]["temperatures"]]
    avg = [stats.mean_spread([eval_by_temperature(e, f"avg@{k}")[t] for e in evals])[0] for t in temps]
    pas = [stats.mean_spread([eval_by_temperature(e, f"pass@{k}")[t] for e in evals])[0] for t in temps]
    out[v] = {"x": temps, "avg": avg, "pass": pas}
  return out


# ----------------------------------------------------------------------------- markdown


def fmt(cell: tuple[float, float, int] | None, scale: float = 1.0, digits: int = 1, sci: bool = False) -> str:
  """'mean ± spread' (scaled; scientific with sci); '-' when missing; no spread for one seed."""
  if cell is None or math.isnan(cell[0]):
    return "-"
  mean, spread, n = cell
  f = (lambda x: f"{x * scale:.{digits}e}") if sci else (lambda x: f"{x * scale:.{digits}f}")
  return f(mean) if n < 2 else f"{f(mean)} ± {f(spread)}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
  return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(table: dict, *, k: int, temperatures: list[float], train_temperature: float, seeds: list[int],
             window: int = 1, base: dict | None = None, base_analyze: dict | None = None,
             plots: list[tuple[str, str]] = (), header: str = "") -> str:
  """The report: training table, Avg@k and Pass@k tables, gap, NLL correlations, plot links."""
  n = lambda v: max((c[2] for c in table[v].values()), default=0)
  cell = lambda v, key, **kw: fmt(table[v].get(key), **kw)
  base_cell = lambda key: fmt((base[key], 0.0, 1), scale=100) if base and key in base else "-"
  lines = [header.rstrip(), ""] if header else []
  lines += [f"Numbers are mean ± standard deviation over seeds {', '.join(map(str, seeds))} (ddof = 1); "
            f"accuracies in %. \"Final\" training numbers average the last {window} steps "
            "(experiment.final_window; Policy-KL: its last logged value when none of them has it).", ""]
  lines += ["## Training (final)", ""]
  lines += _table(["variant", "seeds", "train reward", "train accuracy (%)", "Query-KL", "Policy-KL",
                   "Query-KL / Policy-KL", "entropy"],
                  [[v, str(n(v)), cell(v, "train_reward", digits=3), cell(v, "train_accuracy", scale=100),
                    cell(v, "kl_query", digits=2, sci=True), cell(v, "kl_policy", digits=2, sci=True),
                    cell(v, "kl_ratio", digits=1), cell(v, "entropy", digits=3)] for v in table])
  t_train = closest_temperature(temperatures, train_temperature)
  for short, name in (("avg", f"Avg@{k}"), ("pass", f"Pass@{k}")):
    lines += ["", f"## Held-out {name} (%) by sampling temperature", ""]
    cols = [f"{short}@T={t:g}" for t in temperatures] + [f"{short}/mean", f"{short}/low", f"{short}/high"]
    head = ["variant"] + [f"T={t:g}" for t in temperatures] + ["mean", "low (T<1.0)", "high (T>=1.2)"]
    rows = [[BASE] + [base_cell(c) for c in cols]] if base else []
    rows += [[v] + [cell(v, c, scale=100) for c in cols] for v in table]
    lines += _table(head, rows)
  lines += ["", f"## Train/eval gap (train accuracy - held-out Avg@{k} at T={t_train:g}, the training "
            f"temperature {train_temperature:g} or the closest evaluated)", ""]
  lines += _table(["variant", "train accuracy (%)", f"held-out Avg@{k} (%)", "gap (points)"],
                  [[v, cell(v, "train_accuracy", scale=100), cell(v, "eval_at_train_t", scale=100),
                    cell(v, "gap", scale=100)] for v in table])
  if base_analyze is not None or any("pearson" in table[v] for v in table):
    lines += ["", "## Question NLL vs response NLL (appendix D)", ""]
    rows = []
    if base_analyze is not None:
      rows.append([BASE, f"{base_analyze['pearson']:.3f}", f"{base_analyze['spearman']:.3f}"])
    rows += [[v, cell(v, "pearson", digits=3), cell(v, "spearman", digits=3)] for v in table if "pearson" in table[v]]
    lines += _table(["model", "Pearson", "Spearman"], rows)
  if plots:
    lines += ["", "## Plots", ""]
    for title, rel in plots:
      lines += [f"![{title}]({rel})", ""]
  return "\n".join(lines).rstrip() + "\n"

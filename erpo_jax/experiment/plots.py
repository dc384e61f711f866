"""The report's PNG plots (matplotlib, Agg). Each plot also writes the data it draws to <name>.json beside it.

Every function takes ready series (erpo_jax/experiment/report.py computes them) and
returns the JSON-ready dict it wrote: {"title", "xlabel", "ylabel", "series": {label: {...}}}.
"""

from __future__ import annotations

import json
import math
import pathlib
import typing

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # pylint: disable=wrong-import-position

from erpo_jax.config_run import VariantName  # pylint: disable=wrong-import-position
from erpo_jax.experiment.report import BASE  # pylint: disable=wrong-import-position

SIZE = (6.0, 3.6)  # inches; at DPI 100: 600 x 360 pixels
DPI = 100
BASE_COLOR = "0.45"  # the untrained model: grey in every plot
_PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
            "tab:cyan")
_VARIANT_ORDER = typing.get_args(VariantName)


def color(label: str) -> str:
  """The colour of the model a label names ('grpo', 'grpo-s0', 'grpo Query-KL'): the same in every plot and report.

  Each variant has its own colour, by its place among all variants (not in this grid), so a
  variant keeps its colour whatever the grid holds; other labels take the palette's last colour.
  """
  name = label.split(" ")[0].rsplit("-s", 1)[0]
  if name == BASE:
    return BASE_COLOR
  i = _VARIANT_ORDER.index(name) if name in _VARIANT_ORDER else len(_PALETTE) - 1
  return _PALETTE[i % len(_PALETTE)]


def _label(ax, title: str, xlabel: str, ylabel: str, *, legend: bool, **legend_kw) -> None:
  """Title, axis labels and a light grid; the legend when there is something to name."""
  ax.set_title(title)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if legend:
    ax.legend(**legend_kw)


def _finite(xs, ys, positive: bool = False):
  keep = [(x, y) for x, y in zip(xs, ys)
          if y is not None and math.isfinite(y) and (y > 0 or not positive)]
  return [x for x, _ in keep], [y for _, y in keep]


def _save(fig: Figure, path: pathlib.Path, data: dict) -> dict:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
  return data


def step_plot(path, series: dict[str, tuple[list[int], list[float]]], *, title: str, ylabel: str,
              logy: bool = False, note: str = "") -> dict:
  """One line per label: value against step. With logy, non-positive values are not drawn."""
  fig = Figure(figsize=SIZE)
  ax = fig.add_subplot()
  for label, (steps, values) in series.items():
    xs, ys = _finite(steps, values, positive=logy)
    ax.plot(xs, ys, label=label, color=color(label), linewidth=1.5, marker="o" if len(xs) <= 20 else None,
            markersize=3)
  if logy:
    ax.set_yscale("log")
  _label(ax, title, "step", ylabel, legend=bool(series), fontsize="small")
  data = {"title": title, "xlabel": "step", "ylabel": ylabel, "note": note,
          "series": {label: {"x": list(s), "y": list(v)} for label, (s, v) in series.items()}}
  return _save(fig, path, data)


def kl_pair_plot(path, query: dict[str, tuple[list[int], list[float]]],
                 policy: dict[str, tuple[list[int], list[float]]], *, note: str = "") -> dict:
  """Query-KL (solid) and Policy-KL (dashed) of each variant on one log-scale axis."""
  fig = Figure(figsize=SIZE)
  ax = fig.add_subplot()
  series = {}
  for label in dict.fromkeys([*query, *policy]):
    c = color(label)
    for kind, src, style in (("Query-KL", query, "-"), ("Policy-KL", policy, "--")):
      if label in src:
        xs, ys = _finite(*src[label], positive=True)
        ax.plot(xs, ys, style, color=c, label=f"{label} {kind}", linewidth=1.5)
        series[f"{label} {kind}"] = {"x": list(src[label][0]), "y": list(src[label][1])}
  ax.set_yscale("log")
  title = "Query-KL (solid) vs Policy-KL (dashed)"
  _label(ax, title, "step", "k3 KL to the reference", legend=bool(series), fontsize="x-small", ncol=2)
  return _save(fig, path, {"title": title, "xlabel": "step", "ylabel": "k3 KL to the reference", "note": note,
                           "series": series})


def temperature_plot(path, series: dict[str, dict[str, list[float]]], *, k: int) -> dict:
  """Two panels, Avg@k and Pass@k (%) against temperature; series[label] = {"x": temps, "avg": [...], "pass": [...]}."""
  fig = Figure(figsize=(SIZE[0] * 1.6, SIZE[1]))
  axes = fig.subplots(1, 2)
  for ax, key, name in ((axes[0], "avg", f"Avg@{k}"), (axes[1], "pass", f"Pass@{k}")):
    top = 0.0
    for label, s in series.items():
      xs, ys = _finite(s["x"], [100 * v for v in s[key]])
      ax.plot(xs, ys, label=label, color=color(label), marker="o", markersize=3, linewidth=1.5)
      top = max([top, *ys])
    ax.set_ylim(0, min(100.0, top * 1.15 + 1.0))
    _label(ax, f"{name} against sampling temperature", "temperature", f"{name} (%)", legend=bool(series),
           fontsize="small")
  title = f"held-out accuracy against temperature (Avg@{k}, Pass@{k})"
  return _save(fig, path, {"title": title, "xlabel": "temperature", "ylabel": "%", "k": k,
                           "series": {label: dict(s) for label, s in series.items()}})


def nll_scatter(path, results: dict[str, dict]) -> dict:
  """Question NLL (x) against mean response NLL (y), one colour per model; the legend gives Pearson / Spearman."""
  fig = Figure(figsize=SIZE)
  ax = fig.add_subplot()
  series = {}
  for label, r in results.items():
    ax.scatter(r["question_nll"], r["response_nll"], s=10, alpha=0.7, color=color(label),
               label=f"{label} (r={r['pearson']:.2f}, rho={r['spearman']:.2f})")
    series[label] = {"x": list(r["question_nll"]), "y": list(r["response_nll"]), "pearson": r["pearson"],
                     "spearman": r["spearman"]}
  title = "question NLL vs response NLL"
  _label(ax, title, "question NLL (nats, summed over prompt tokens)", "response NLL (nats, mean of G)",
         legend=bool(results), fontsize="x-small")
  return _save(fig, path, {"title": title, "xlabel": "question NLL", "ylabel": "response NLL", "series": series})

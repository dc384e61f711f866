"""`erpo-jax experiment`: train every run of the grid, evaluate and analyse each final checkpoint, write the report.

    <experiment.dir>/experiment.yaml         the experiment's config
    <experiment.dir>/runs/<variant>-s<seed>/  ordinary run folders (+ eval/, analyze/)
    <experiment.dir>/base/                    the untrained model's eval and analysis
    <experiment.dir>/cache/                   the reference cache every run shares
    <experiment.dir>/progress.jsonl           one line per finished phase, with its seconds
    <experiment.dir>/report.md, summary.json, plots/*.png (+ the plotted data as plots/*.json)

Rerunning skips what is done (a run with its final checkpoint, an eval or analysis
with its JSON), resumes an interrupted run from its checkpoint, and refuses a run
folder whose config.yaml differs from the run's config now. A run whose eval and
analysis are done needs its checkpoint no more: the folder may be moved, or kept
without checkpoints/ and cache/ (what docs/results/ holds), and still reports and
resumes without training again.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

from erpo_jax.config import Config
from erpo_jax.config_io import dump_config
from erpo_jax.errors import PathError
from erpo_jax.eval.evaluate import run_eval
from erpo_jax.experiment import grid, plots, report
from erpo_jax.experiment.analyze import JSON_NAME, run_analyze
from erpo_jax.experiment.grid import RunSpec
from erpo_jax.metrics import METRICS_FILE, read_jsonl
from erpo_jax.train.checkpoint_io import find_checkpoint
from erpo_jax.train.loop import train

PROGRESS_FILE = "progress.jsonl"
PHASES = ("train", "eval", "analyze")


# ----------------------------------------------------------------------------- what is done


def _final_step_dir(cfg: Config) -> pathlib.Path | None:
  try:
    return find_checkpoint(str(cfg.train.steps), cfg.run.dir)
  except PathError:
    return None


def eval_path(cfg: Config) -> pathlib.Path:
  return pathlib.Path(cfg.run.dir) / "eval" / f"eval_step{cfg.train.steps}.json"


def analyze_dir(cfg: Config) -> pathlib.Path:
  return pathlib.Path(cfg.run.dir) / "analyze" / f"step{cfg.train.steps}"


def base_eval_path(cfg: Config) -> pathlib.Path:
  return pathlib.Path(cfg.run.dir) / "eval" / "eval_base.json"


def base_analyze_dir(cfg: Config) -> pathlib.Path:
  return pathlib.Path(cfg.run.dir) / "analyze" / "base"


def _trained(cfg: Config, analyze_num: int) -> bool:
  """The final checkpoint is there, or everything made from it is (a run kept without its checkpoints)."""
  if _final_step_dir(cfg) is not None:
    return True
  made = [pathlib.Path(cfg.run.dir) / METRICS_FILE, eval_path(cfg)]
  if analyze_num:
    made.append(analyze_dir(cfg) / JSON_NAME)
  return all(p.is_file() for p in made)


def _read_json(path: pathlib.Path) -> dict | None:
  return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------- progress


def _hms(seconds: float) -> str:
  s = int(round(seconds))
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
  """One console line per task and phase; the time left from the mean seconds of each phase done so far."""

  def __init__(self, path: pathlib.Path, tasks: list[tuple[str, str]], out=None):
    self.path, self.tasks, self.out = path, tasks, out or sys.stdout
    self.seconds: dict[str, list[float]] = {p: [] for p in ("base_eval", "base_analyze", *PHASES)}
    if path.is_file():
      for line in path.read_text().splitlines():
        rec = json.loads(line)
        self.seconds.setdefault(rec["phase"], []).append(rec["seconds"])
    self.start = time.monotonic()

  def left(self, after: int) -> str:
    """Estimated time of the tasks after index `after` that are not done ('+ ?' for phases not yet timed)."""
    total, unknown = 0.0, False
    for _, phase, done in self.tasks[after + 1:]:
      if done:
        continue
      if self.seconds.get(phase):
        total += sum(self.seconds[phase]) / len(self.seconds[phase])
      else:
        unknown = True
    if unknown and total == 0:
      return "time left not known yet"
    return f"~{_hms(total)}{' + ?' if unknown else ''} left"

  def line(self, i: int, text: str) -> None:
    print(f"experiment [{i + 1}/{len(self.tasks)}] {text}", file=self.out, flush=True)

  def done(self, i: int, name: str, phase: str, seconds: float) -> None:
    self.seconds.setdefault(phase, []).append(seconds)
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"task": name, "phase": phase, "seconds": round(seconds, 3)}) + "\n")
    self.line(i, f"{name} {phase}: done in {_hms(seconds)}; elapsed {_hms(time.monotonic() - self.start)}, "
                 f"{self.left(i)}")


# ----------------------------------------------------------------------------- the grid


def _tasks(cfg: Config, specs: list[RunSpec]):
  """[(name, phase, done, action)] in order: the untrained model's eval/analysis, then train, eval, analyze per run."""

  exp = cfg.experiment
  base = grid.base_config(cfg)
  out = []
  if exp.base_eval:
    out.append((report.BASE, "base_eval", base_eval_path(base).is_file(),
                lambda: _evaluate(base, None, base_eval_path(base))))
  if exp.analyze_num:
    out.append((report.BASE, "base_analyze", (base_analyze_dir(base) / JSON_NAME).is_file(),
                lambda: run_analyze(base, num=exp.analyze_num, seed=exp.analyze_seed, out=str(base_analyze_dir(base)),
                                    title=report.BASE)))
  for s in specs:
    c = s.cfg
    out.append((s.name, "train", _trained(c, exp.analyze_num), lambda c=c: _train(c)))
    out.append((s.name, "eval", eval_path(c).is_file(),
                lambda c=c: _evaluate(c, str(c.train.steps), eval_path(c))))
    if exp.analyze_num:
      out.append((s.name, "analyze", (analyze_dir(c) / JSON_NAME).is_file(),
                  lambda c=c, n=s.name: run_analyze(c, checkpoint=str(c.train.steps), num=exp.analyze_num,
                                                    seed=exp.analyze_seed, out=str(analyze_dir(c)), title=n)))
  return out


def _train(cfg: Config) -> None:
  train(cfg)


def _evaluate(cfg: Config, checkpoint: str | None, out: pathlib.Path) -> None:
  run_eval(cfg, checkpoint=checkpoint, out=str(out))


def run_experiment(cfg: Config, *, out=None) -> pathlib.Path | None:
  """Runs (or resumes) the grid of cfg.experiment and writes the report; returns the report's path.

  A run stopped by SIGTERM (the trainer saves and returns) stops the experiment too: None.
  """
  exp = cfg.experiment
  root = pathlib.Path(exp.dir)
  specs = grid.plan(cfg)
  for s in specs:  # a changed config is refused before anything runs
    grid.check_existing(s)
  try:
    root.mkdir(parents=True, exist_ok=True)
    (root / "experiment.yaml").write_text(dump_config(cfg))
  except OSError as e:
    raise PathError(f"experiment.dir '{root}' is not a writable folder ({e.strerror or e}); "
                    "give experiment.dir=<a folder you can write>") from None
  tasks = _tasks(cfg, specs)
  progress = Progress(root / PROGRESS_FILE, [(n, p, d) for n, p, d, _ in tasks], out=out)
  for i, (name, phase, done, action) in enumerate(tasks):
    if done:
      progress.line(i, f"{name} {phase}: done before, skipped")
      continue
    if phase == "train":
      grid.check_existing(next(s for s in specs if s.name == name))
    progress.line(i, f"{name} {phase}: started; {progress.left(i - 1)}")
    t0 = time.monotonic()
    action()
    if phase == "train" and _final_step_dir(next(s.cfg for s in specs if s.name == name)) is None:
      progress.line(i, f"{name} train: stopped before its last step; run the same command to resume")
      return None
    progress.done(i, name, phase, time.monotonic() - t0)
  path = write_report(cfg, specs)
  progress.line(len(tasks) - 1, f"report: {path}")
  return path


def write_partial_report(cfg: Config) -> pathlib.Path:
  """report.md and plots from the runs and evaluations finished so far (a grid still running, or stopped)."""
  root = pathlib.Path(cfg.experiment.dir)
  if not (root / "experiment.yaml").is_file():
    raise PathError(f"experiment.dir '{root}' holds no experiment (no experiment.yaml); run "
                    "'erpo-jax experiment --config ...' first")
  specs = grid.plan(cfg)
  for s in specs:
    grid.check_existing(s)
  return write_report(cfg, specs)


# ----------------------------------------------------------------------------- the report


def load_runs(specs: list[RunSpec]) -> list[report.RunData]:
  """What each finished run left on disk: a run still training (or stopped) before its last step is left out,
  so that no table or plot mixes its figures so far with final ones."""

  out = []
  for s in specs:
    metrics = s.dir / METRICS_FILE
    rows = read_jsonl(metrics) if metrics.is_file() else []
    if not rows or max(r.get("step", 0) for r in rows) < s.cfg.train.steps:
      continue
    out.append(report.RunData(s.variant, s.seed, rows, _read_json(eval_path(s.cfg)),
                              _read_json(analyze_dir(s.cfg) / JSON_NAME)))
  return out


def _header(cfg: Config) -> str:
  d, r, e, exp = cfg.data, cfg.rollout, cfg.eval, cfg.experiment
  lines = [f"# Ablation: {', '.join(exp.variants)} x seeds {', '.join(map(str, exp.seeds))}", "",
           f"Model `{cfg.model.path}`, data `{d.source}` (levels {list(d.levels)}), {cfg.train.steps} steps of "
           f"B = {d.batch_size} prompts x G = {r.group_size} samples, up to {r.max_new_tokens} new tokens at "
           f"temperature {r.temperature:g}, alpha {cfg.erpo.alpha:g}, lr {cfg.optim.lr:g}. Held-out eval: "
           f"{', '.join(e.sets)}, {e.max_problems or 'all'} problems, k = {e.k}, temperatures "
           f"{', '.join(f'{t:g}' for t in e.temperatures)}.", "",
           "Variants (overrides of the experiment's config; each seed sets train.seed and data.shuffle_seed):", ""]
  for v in exp.variants:
    lines.append(f"- `{v}`: " + " ".join(f"`{k}={val}`" for k, val in grid.VARIANTS[v].items()))
  return "\n".join(lines)


def write_report(cfg: Config, specs: list[RunSpec]) -> pathlib.Path:
  """report.md, summary.json and plots/ from what the runs left."""

  exp = cfg.experiment
  root = pathlib.Path(exp.dir)
  variants = list(exp.variants)
  runs = load_runs(specs)
  base = grid.base_config(cfg)
  base_eval = _read_json(base_eval_path(base))
  base_analyze = _read_json(base_analyze_dir(base) / JSON_NAME)
  kw = {"train_temperature": cfg.rollout.temperature, "window": exp.final_window}
  table = report.variant_table(runs, [v for v in variants if any(r.variant == v for r in runs)], **kw)

  plot_dir = root / "plots"
  links = []
  series = {}
  for stem, key, title, ylabel in report.STEP_PLOTS:
    series[key] = report.step_series(runs, variants, key, exp.smooth)
    note = "mean over seeds" + (f", trailing mean over {exp.smooth} steps" if exp.smooth > 1 else "")
    if key == "kl/policy":
      note += "; with erpo.reference=cached Policy-KL is logged every log.policy_kl_every steps"
    plots.step_plot(plot_dir / f"{stem}.png", series[key], title=f"{title} ({note.split(';')[0]})", ylabel=ylabel,
                    note=note)
    links.append((title, f"plots/{stem}.png"))
  plots.kl_pair_plot(plot_dir / "kl_query_vs_policy.png", series["kl/query"], series["kl/policy"])
  links.append(("Query-KL vs Policy-KL", "plots/kl_query_vs_policy.png"))
  temps = report.temperature_series(runs, variants, base_eval)
  k = next((r.eval["k"] for r in runs if r.eval), (base_eval or {}).get("k", cfg.eval.k))
  plots.temperature_plot(plot_dir / "accuracy_temperature.png", temps, k=k)
  links.append(("accuracy against temperature", "plots/accuracy_temperature.png"))
  scatter = {report.BASE: base_analyze} if base_analyze else {}
  for v in variants:  # the first seed of each variant: one cloud per model stays readable
    first = next((r for r in runs if r.variant == v and r.analyze), None)
    if first is not None:
      scatter[grid.run_name(v, first.seed)] = first.analyze
  if scatter:
    plots.nll_scatter(plot_dir / "nll_scatter.png", scatter)
    links.append(("question NLL vs response NLL", "plots/nll_scatter.png"))

  base_summary = report.eval_summary(base_eval) if base_eval else None
  text = report.markdown(table, k=k, temperatures=list(cfg.eval.temperatures),
                         train_temperature=cfg.rollout.temperature, seeds=list(exp.seeds), window=exp.final_window,
                         base=base_summary, base_analyze=base_analyze, plots=links, header=_header(cfg))
  missing = [s.name for s in specs if not any(r.variant == s.variant and r.seed == s.seed and r.eval for r in runs)]
  if missing:
    text += f"\nNot yet evaluated: {', '.join(missing)}.\n"
  (root / "report.md").write_text(text)
  summary = {"variants": {v: {key: list(c) for key, c in cells.items()} for v, cells in table.items()},
             "runs": {grid.run_name(r.variant, r.seed): report.run_summary(r, **kw) for r in runs},
             "base": base_summary}
  (root / "summary.json").write_text(json.dumps(_json_safe(summary), indent=1) + "\n")
  return root / "report.md"


def _json_safe(x):
  """NaN -> None (strict JSON)."""
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  return None if isinstance(x, float) and math.isnan(x) else x

"""`erpo-jax experiment` end to end on the tiny model, and `erpo-jax analyze` against a by-hand NLL."""

import hashlib
import json
import math
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
from flax import nnx
from tiny_runs import REPO, child_env

from erpo_jax.config_io import load_config
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.experiment import analyze, stats
from erpo_jax.metrics import read_jsonl
from erpo_jax.model import logprobs
from erpo_jax.model.io.loading import load_model

TINY_GRID = str(REPO / "configs" / "ablation_tiny.yaml")
RUNS = ("grpo-s0", "erpo_static-s0", "grpo-s1", "erpo_static-s1")
STEP_PLOTS = ("reward", "kl_query", "kl_policy", "entropy", "response_len")
PLOTS = STEP_PLOTS + ("kl_query_vs_policy", "accuracy_temperature", "nll_scatter")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def experiment(folder, *overrides):
  return subprocess.run([sys.executable, "-m", "erpo_jax.cli", "experiment", "--config", TINY_GRID,
                         f"experiment.dir={folder}", *overrides], cwd=REPO, env=child_env(), capture_output=True,
                        text=True, timeout=600)


def started(stdout: str) -> list[str]:
  """'<run> <phase>' of each phase the command ran (not skipped)."""
  return [line.split("] ", 1)[1].split(":")[0] for line in stdout.splitlines()
          if line.startswith("experiment [") and ": started" in line]


def tree_hashes(folder: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
  """One tiny experiment: grpo and erpo_static x seeds 0, 1 x 3 steps, eval at 3 temperatures, 3-question analyses."""
  folder = tmp_path_factory.mktemp("experiment") / "exp"
  proc = experiment(folder)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return folder, proc


def series_mean(folder, variant, key):
  """Per step, the mean over both seeds' metrics.jsonl values of `key` (the data behind a step plot)."""
  rows = [read_jsonl(folder / "runs" / f"{variant}-s{s}" / "metrics.jsonl") for s in (0, 1)]
  steps = sorted({r["step"] for rs in rows for r in rs if key in r})
  return steps, [float(np.mean([r[key] for rs in rows for r in rs if r["step"] == s and key in r])) for s in steps]


def test_the_grid_runs_every_phase_once_and_leaves_ordinary_run_folders(grid):
  folder, proc = grid
  assert started(proc.stdout) == ["untrained base_eval", "untrained base_analyze"] + [
      f"{r} {p}" for r in RUNS for p in ("train", "eval", "analyze")]
  lines = [line for line in proc.stdout.splitlines() if line.startswith("experiment [")]
  assert all(" left" in line for line in lines if ": started" in line or ": done in" in line)
  assert lines[-2].endswith("~0m00s left") and lines[-1] == f"experiment [14/14] report: {folder / 'report.md'}"
  for run in RUNS:
    d = folder / "runs" / run
    assert [r["step"] for r in read_jsonl(d / "metrics.jsonl")] == [1, 2, 3]
    assert (d / "checkpoints" / "3").is_dir() and (d / "eval" / "eval_step3.json").is_file()
    assert json.loads((d / "analyze" / "step3" / "analyze.json").read_text())["num"] == 3
    cfg = load_config(d / "config.yaml")
    assert cfg.train.seed == int(run[-1]) and cfg.run.dir == str(d)
  assert load_config(folder / "runs" / "grpo-s0" / "config.yaml").erpo.kl_on == "response"
  assert load_config(folder / "runs" / "erpo_static-s1" / "config.yaml").erpo.weights == "static"


def test_every_table_and_plot_is_written_and_the_report_links_the_plots(grid):
  folder, _ = grid
  text = (folder / "report.md").read_text()
  for heading in ("## Training (final)", "## Held-out Avg@2 (%) by sampling temperature",
                  "## Held-out Pass@2 (%) by sampling temperature", "## Train/eval gap",
                  "## Question NLL vs response NLL"):
    assert heading in text, heading
  assert text.count("| grpo |") == 5 and text.count("| erpo_static |") == 5  # every table
  assert text.count("| untrained |") == 3  # Avg@k, Pass@k and the NLL table
  assert "| variant | T=0.5 | T=1 | T=1.5 | mean | low (T<1.0) | high (T>=1.2) |" in text
  for name in PLOTS:
    assert f"(plots/{name}.png)" in text, name
    png = folder / "plots" / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 200_000
    h, w = matplotlib.image.imread(png).shape[:2]
    assert (h, w) == ((360, 960) if name == "accuracy_temperature" else (360, 600)), name
  summary = json.loads((folder / "summary.json").read_text())
  assert sorted(summary["runs"]) == sorted(RUNS) and set(summary["variants"]) == {"grpo", "erpo_static"}


def test_step_plots_draw_the_mean_over_seeds_of_each_metric(grid):
  folder, _ = grid
  for stem, key in zip(STEP_PLOTS, ("reward/mean", "kl/query", "kl/policy", "entropy/mean", "response/len_mean")):
    data = json.loads((folder / "plots" / f"{stem}.json").read_text())
    assert set(data["series"]) == {"grpo", "erpo_static"}, stem
    assert data["xlabel"] == "step" and data["title"]
    for variant, s in data["series"].items():
      steps, values = series_mean(folder, variant, key)
      assert s["x"] == steps == [1, 2, 3], (stem, variant)
      assert s["y"] == pytest.approx(values, rel=1e-12), (stem, variant)
  pair = json.loads((folder / "plots" / "kl_query_vs_policy.json").read_text())
  assert set(pair["series"]) == {"grpo Query-KL", "grpo Policy-KL", "erpo_static Query-KL", "erpo_static Policy-KL"}
  assert pair["series"]["grpo Policy-KL"]["y"] == pytest.approx(series_mean(folder, "grpo", "kl/policy")[1])


def test_accuracy_and_scatter_plots_draw_the_eval_and_analysis_results(grid):
  folder, _ = grid
  data = json.loads((folder / "plots" / "accuracy_temperature.json").read_text())
  assert list(data["series"]) == ["untrained", "grpo", "erpo_static"]
  for variant in ("grpo", "erpo_static"):
    evals = [json.loads((folder / "runs" / f"{variant}-s{s}" / "eval" / "eval_step3.json").read_text())
             for s in (0, 1)]
    s = data["series"][variant]
    assert s["x"] == [0.5, 1.0, 1.5]
    for t, avg, pas in zip(s["x"], s["avg"], s["pass"]):
      assert avg == pytest.approx(np.mean([e["mean"]["by_temperature"][f"t{t}"]["avg@2"] for e in evals]))
      assert pas == pytest.approx(np.mean([e["mean"]["by_temperature"][f"t{t}"]["pass@2"] for e in evals]))
  base = json.loads((folder / "base" / "eval" / "eval_base.json").read_text())
  assert data["series"]["untrained"]["avg"] == [base["mean"]["by_temperature"][f"t{t}"]["avg@2"]
                                                for t in (0.5, 1.0, 1.5)]
  scatter = json.loads((folder / "plots" / "nll_scatter.json").read_text())
  assert list(scatter["series"]) == ["untrained", "grpo-s0", "erpo_static-s0"]
  points = json.loads((folder / "runs" / "grpo-s0" / "analyze" / "step3" / "analyze.json").read_text())
  assert scatter["series"]["grpo-s0"]["x"] == points["question_nll"]
  assert scatter["series"]["grpo-s0"]["y"] == points["response_nll"]


def test_a_rerun_redoes_a_deleted_run_and_eval_and_resumes_a_run_from_its_checkpoint(grid):
  folder, _ = grid
  shutil.rmtree(folder / "runs" / "grpo-s1")
  (folder / "runs" / "erpo_static-s0" / "eval" / "eval_step3.json").unlink()
  stopped = folder / "runs" / "erpo_static-s1"  # as if stopped after step 2: no step-3 checkpoint, eval or analysis
  shutil.rmtree(stopped / "checkpoints" / "3")
  shutil.rmtree(stopped / "eval")
  shutil.rmtree(stopped / "analyze")
  kept = {"grpo-s0": tree_hashes(folder / "runs" / "grpo-s0")}
  # --report-only reports what is there and runs nothing.
  partial = experiment(folder, "--report-only")
  assert partial.returncode == 0, partial.stderr[-3000:]
  assert started(partial.stdout) == [] and not (folder / "runs" / "grpo-s1").exists()
  text = (folder / "report.md").read_text()
  assert "Not yet evaluated: erpo_static-s0, grpo-s1, erpo_static-s1." in text and "| grpo | 1 |" in text, text
  proc = experiment(folder)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert started(proc.stdout) == ["erpo_static-s0 eval", "grpo-s1 train", "grpo-s1 eval", "grpo-s1 analyze",
                                  "erpo_static-s1 train", "erpo_static-s1 eval", "erpo_static-s1 analyze"]
  assert proc.stdout.count("done before, skipped") == 14 - 7
  assert {r: tree_hashes(folder / "runs" / r) for r in kept} == kept  # untouched
  assert f"resumed from {folder / 'runs' / 'erpo_static-s1'}/checkpoints at step 2" in proc.stdout + proc.stderr
  for run in ("grpo-s1", "erpo_static-s1"):
    assert [r["step"] for r in read_jsonl(folder / "runs" / run / "metrics.jsonl")] == [1, 2, 3]
    assert (folder / "runs" / run / "checkpoints" / "3").is_dir()
  assert (folder / "runs" / "erpo_static-s0" / "eval" / "eval_step3.json").is_file()
  assert "| grpo | 2 |" in (folder / "report.md").read_text()


def test_a_changed_config_for_an_existing_run_folder_is_refused_with_exit_code_2(grid):
  folder, _ = grid
  proc = experiment(folder, "optim.lr=5e-4")
  assert proc.returncode == 2
  err = proc.stderr.strip().splitlines()
  assert len(err) == 1, proc.stderr
  assert err[0].startswith("erpo-jax experiment: error: experiment: run folder ")
  assert "grpo-s0 was made with another config (optim.lr: 0.001 -> 0.0005)" in err[0]


@pytest.mark.slow
def test_a_finished_grid_moved_without_checkpoints_and_cache_reports_and_reruns_nothing(grid, tmp_path):
  folder, _ = grid
  assert experiment(folder).returncode == 0  # the grid is whole again after the tests above
  moved = tmp_path / "published"
  shutil.copytree(folder, moved, ignore=shutil.ignore_patterns("checkpoints", "cache"))
  assert not list(moved.rglob("checkpoints"))
  proc = experiment(moved)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert started(proc.stdout) == [] and proc.stdout.count("done before, skipped") == 14
  assert json.loads((moved / "summary.json").read_text()) == json.loads((folder / "summary.json").read_text())
  assert (moved / "report.md").read_text() == (folder / "report.md").read_text()
  # A run missing its analysis (and its checkpoint) is trained again: nothing else could make the analysis.
  shutil.rmtree(moved / "runs" / "grpo-s1" / "analyze")
  proc = experiment(moved)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert started(proc.stdout) == ["grpo-s1 train", "grpo-s1 analyze"]


# ----------------------------------------------------------------------------- analyze


def test_analyze_agrees_with_a_by_hand_nll_of_three_questions():

  cfg = load_config("configs/tiny.yaml", ["rollout.max_new_tokens=6"])
  model, tokenizer = load_model(cfg.model)
  res = analyze.analyze_model(cfg, model, tokenizer, num=3, seed=5)
  prompts = [tokens for tokens, _ in dataset_prompts(cfg, tokenizer)]
  graphdef, state = nnx.split(model)
  S = 64  # every sequence right-padded to one length: one compile; padding after x_t does not change log p(x_t)
  by_hand = jax.jit(lambda state, t: logprobs.log_probs(nnx.merge(graphdef, state), t))

  def log_probs(ids):
    return np.asarray(by_hand(state, jnp.asarray([ids + [0] * (S - len(ids))])))[0, :len(ids)]

  assert res["num"] == 3 and len(res["index"]) == 3 and res["index"] == sorted(set(res["index"]))
  G = cfg.rollout.group_size
  for i, q in enumerate(res["index"]):
    ids = prompts[q]
    logp = log_probs(ids)
    assert res["question_nll"][i] == pytest.approx(-logp[1:].sum(), rel=1e-5)  # every prompt position but the first
    responses = res["responses"][i]
    assert len(responses) == G and all(1 <= len(r) <= 6 for r in responses)
    nll = []
    for r in responses:
      full = log_probs(ids + r)
      nll.append(-full[len(ids):].sum())
    assert res["response_nll"][i] == pytest.approx(np.mean(nll), rel=1e-5)
    assert res["response_nll_per_token"][i] == pytest.approx(np.mean([n / len(r) for n, r in zip(nll, responses)]),
                                                             rel=1e-5)
  assert res["pearson"] == stats.pearson(res["question_nll"], res["response_nll"])
  assert res["spearman"] == stats.spearman(res["question_nll"], res["response_nll"])
  assert not math.isnan(res["pearson"])

  # erpo.query_span=question: the question NLL sums over the question's tokens only, as training scores them
  # (chat template on, so the prompt holds more than the question).
  qcfg = load_config("configs/tiny.yaml", ["rollout.max_new_tokens=6", "erpo.query_span=question",
                                           "data.chat_template=true", "data.max_prompt_tokens=0"])
  qres = analyze.analyze_model(qcfg, model, tokenizer, num=3, seed=5)
  rows = dataset_prompts(qcfg, tokenizer)
  assert qres["index"] == res["index"] and qres["query_span"] == "question"
  for i, q in enumerate(qres["index"]):
    ids, m = rows[q][0], np.asarray(rows[q][1], bool)
    assert 0 < m.sum() < len(ids) - 5  # the question is a strict part of the templated prompt
    logp = log_probs(ids)
    assert qres["question_nll"][i] == pytest.approx(-logp[1:][m[1:]].sum(), rel=1e-5)
    assert qres["question_nll"][i] < -logp[1:].sum()


@pytest.mark.slow
def test_analyze_command_prints_the_correlations_and_writes_json_and_png(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "analyze", "--config", str(REPO / "configs/tiny.yaml"),
                         "--num", "3", "--out", str(tmp_path / "a"), f"run.dir={tmp_path / 'run'}"], cwd=REPO,
                        env=child_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "3 questions x 4 responses: question NLL vs response NLL Pearson " in proc.stdout
  saved = json.loads((tmp_path / "a" / "analyze.json").read_text())
  assert len(saved["question_nll"]) == 3 and saved["checkpoint"] is None
  assert (tmp_path / "a" / "analyze.png").read_bytes()[:8] == PNG_MAGIC
  bad = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "analyze", "--config", str(REPO / "configs/tiny.yaml"),
                        "--num", "0"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=600)
  assert bad.returncode == 2 and bad.stderr.strip() == \
      "erpo-jax analyze: error: analyze: --num expected an integer >= 1, got 0"

"""The ablation report's pure parts: statistics, per-run and per-variant numbers, the grid's configs, progress."""

import io
import json
import math
import typing

import pytest

from erpo_jax.config import Config
from erpo_jax.config_io import dump_config, load_config
from erpo_jax.config_run import VariantName
from erpo_jax.errors import UserError
from erpo_jax.experiment import grid, report, runner, stats
from erpo_jax.experiment.runner import Progress

# ----------------------------------------------------------------------------- statistics


def test_mean_spread_is_the_mean_and_the_ddof1_standard_deviation():
  assert stats.mean_spread([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, math.sqrt(5 / 3)))
  assert stats.mean_spread([0.2, 0.4]) == pytest.approx((0.3, math.sqrt(0.02)))
  assert stats.mean_spread([0.5]) == (0.5, 0.0)  # one seed: no spread
  assert stats.mean_spread([1.0, math.nan, 3.0]) == pytest.approx((2.0, math.sqrt(2)))  # a missing seed left out
  assert all(math.isnan(x) for x in stats.mean_spread([]))


def test_bands_split_the_sweep_below_1_0_and_from_1_2():
  by_t = {0.1: 0.2, 0.5: 0.4, 1.0: 0.9, 1.1: 0.8, 1.2: 0.3, 1.5: 0.1}
  assert stats.band_means(by_t) == pytest.approx({"low": 0.3, "high": 0.2})  # 1.0 and 1.1 in neither band
  assert [stats.band_of(t) for t in (0.99, 1.0, 1.19, 1.2)] == ["low", None, None, "high"]
  assert math.isnan(stats.band_means({0.5: 1.0})["high"])


def test_pearson_of_a_worked_example_is_6_over_sqrt_60():
  # dx = -2..2, dy = -2, 0, 1, 0, 1: sum dx dy = 6, sum dx^2 = 10, sum dy^2 = 6.
  assert stats.pearson([1, 2, 3, 4, 5], [2, 4, 5, 4, 5]) == pytest.approx(6 / math.sqrt(60), abs=1e-12)
  assert stats.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
  assert math.isnan(stats.pearson([1, 2, 3], [4, 4, 4]))  # a constant variable has no correlation
  assert math.isnan(stats.pearson([1], [2]))


def test_spearman_averages_tied_ranks():
  assert stats.ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
  # y ranks 1, 2.5, 4.5, 2.5, 4.5 against 1..5: sum dx dy = 7, sum dy^2 = 9.
  assert stats.spearman([1, 2, 3, 4, 5], [2, 4, 5, 4, 5]) == pytest.approx(7 / math.sqrt(90), abs=1e-12)
  # Monotone but not linear: Spearman 1, Pearson below 1.
  assert stats.spearman([1, 2, 3], [1, 10, 100]) == pytest.approx(1.0)
  # dx = -1, 0, 1; dy = -36, -27, 63: sum dx dy = 99, sum dx^2 = 2, sum dy^2 = 5994.
  assert stats.pearson([1, 2, 3], [1, 10, 100]) == pytest.approx(99 / math.sqrt(2 * 5994), abs=1e-12)


def test_final_value_averages_the_last_window_or_takes_the_last_sparse_value():
  rows = [{"step": s, "reward/mean": s / 10} for s in range(1, 11)]
  for r in rows:
    if r["step"] in (5, 10):
      r["kl/policy"] = r["step"] / 100
  assert stats.final_value(rows, "reward/mean", 3) == pytest.approx(0.9)  # steps 8, 9, 10
  assert stats.final_value(rows, "kl/policy", 3) == pytest.approx(0.10)  # only step 10 in the window
  assert stats.final_value(rows[:9], "kl/policy", 3) == pytest.approx(0.05)  # none in 7..9: the last, step 5
  assert math.isnan(stats.final_value(rows, "entropy/mean", 3))


def test_series_mean_over_seeds_per_step_and_trailing_average():
  a = ([1, 2, 3], [1.0, 2.0, 3.0])
  b = ([1, 2], [3.0, 4.0])
  assert stats.mean_over_seeds([a, b]) == ([1, 2, 3], [2.0, 3.0, 3.0])
  assert stats.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
  assert stats.step_series([{"step": 2, "x": 5.0}, {"step": 1, "x": 4.0}, {"step": 3}], "x") == ([1, 2], [4.0, 5.0])


# ----------------------------------------------------------------------------- report numbers


def eval_result(avg: dict, pas: dict, k: int = 2) -> dict:
  """An eval results dict with one set; `avg`, `pas`: {temperature: value}."""
  by_t = {f"t{float(t)}": {f"avg@{k}": avg[t], f"pass@{k}": pas[t]} for t in avg}
  return {"k": k, "temperatures": list(avg), "sets": {}, "mean": {"by_temperature": by_t}}


def run(variant, seed, reward, acc, avg, pas):
  rows = [{"step": 1, "reward/mean": 0.0, "reward/accuracy": 0.0, "kl/query": 0.0, "kl/policy": 0.0},
          {"step": 2, "reward/mean": reward, "reward/accuracy": acc, "kl/query": 0.02, "entropy/mean": 0.5}]
  return report.RunData(variant, seed, rows, eval_result(avg, pas))


def test_run_summary_gives_bands_mean_and_the_gap_at_the_training_temperature():
  r = run("grpo", 0, 0.5, 0.4, {0.5: 0.30, 1.0: 0.20, 1.5: 0.10}, {0.5: 0.5, 1.0: 0.4, 1.5: 0.3})
  s = report.run_summary(r, train_temperature=1.0, window=1)
  assert s["train_reward"] == 0.5 and s["train_accuracy"] == 0.4
  assert s["kl_query"] == 0.02 and s["kl_policy"] == 0.0 and s["entropy"] == 0.5
  assert math.isnan(s["kl_ratio"])  # no Policy-KL drift yet: no ratio
  r.rows[1]["kl/policy"] = 0.004
  assert report.run_summary(r, train_temperature=1.0, window=1)["kl_ratio"] == pytest.approx(5.0)
  assert s["avg@T=0.5"] == 0.30 and s["pass@T=1.5"] == 0.3
  assert s["avg/mean"] == pytest.approx(0.2) and s["pass/mean"] == pytest.approx(0.4)
  assert s["avg/low"] == 0.30 and s["avg/high"] == 0.10
  assert s["eval_at_train_t"] == 0.20 and s["gap"] == pytest.approx(0.2)
  # Training at 0.9 with a sweep 0.5, 1.0, 1.5: the gap uses 1.0, the closest.
  assert report.run_summary(r, train_temperature=0.9, window=1)["eval_at_train_t"] == 0.20


def test_variant_table_gives_mean_and_spread_over_seeds_and_the_markdown_shows_them():
  runs = [run("grpo", 0, 0.5, 0.4, {0.5: 0.30, 1.5: 0.10}, {0.5: 0.5, 1.5: 0.3}),
          run("grpo", 1, 0.3, 0.2, {0.5: 0.10, 1.5: 0.30}, {0.5: 0.5, 1.5: 0.5}),
          run("erpo_static", 0, 0.6, 0.6, {0.5: 0.40, 1.5: 0.40}, {0.5: 0.6, 1.5: 0.6})]
  table = report.variant_table(runs, ["grpo", "erpo_static"], train_temperature=1.0, window=1)
  mean, spread, n = table["grpo"]["train_reward"]
  assert (mean, spread, n) == pytest.approx((0.4, math.sqrt(0.02), 2))
  assert table["grpo"]["avg/mean"] == pytest.approx((0.2, 0.0, 2))  # both seeds average 0.2 over the sweep
  assert table["erpo_static"]["avg@T=1.5"] == (0.4, 0.0, 1)
  text = report.markdown(table, k=2, temperatures=[0.5, 1.5], train_temperature=1.0, seeds=[0, 1],
                         base=report.eval_summary(eval_result({0.5: 0.05, 1.5: 0.0}, {0.5: 0.1, 1.5: 0.0})),
                         plots=[("reward", "plots/reward.png")])
  assert "| grpo | 20.0 ± 14.1 | 20.0 ± 14.1 | 20.0 ± 0.0 | 20.0 ± 14.1 | 20.0 ± 14.1 |" in text
  assert "| untrained | 5.0 | 0.0 | 2.5 | 5.0 | 0.0 |" in text
  assert "| erpo_static | 1 | 0.600 | 60.0 |" in text  # one seed: no spread
  assert "![reward](plots/reward.png)" in text
  series = report.temperature_series(runs, ["grpo", "erpo_static"])
  assert series["grpo"] == {"x": [0.5, 1.5], "avg": pytest.approx([0.2, 0.2]), "pass": pytest.approx([0.5, 0.4])}


# ----------------------------------------------------------------------------- the grid


def test_variant_names_of_the_config_and_the_table_agree_and_each_is_one_override_set():
  assert set(typing.get_args(VariantName)) == set(grid.VARIANTS)
  base = load_config("configs/ablation_small.yaml")
  got = {v: (c.erpo.kl_on, c.erpo.weights) for v in grid.VARIANTS for c in [grid.run_config(base, v, 0)]}
  assert got == {"grpo": ("response", "none"), "grpo_star": ("none", "static"), "query_kl": ("prompt", "none"),
                 "erpo_static": ("prompt", "static"), "erpo_dynamic": ("prompt", "dynamic"),
                 "rloo": ("response", "none"), "rloo_erpo": ("prompt", "static"), "dapo": ("none", "none"),
                 "dapo_erpo": ("prompt", "static")}
  assert grid.run_config(base, "grpo", 0).erpo.reference == "forward"  # a response KL needs the reference forward


@pytest.mark.parametrize("variant", ["rloo", "rloo_erpo", "dapo", "dapo_erpo"])
def test_rloo_and_dapo_variants_on_the_default_are_their_config_files_and_fit_every_grid(variant):
  got = grid.run_config(load_config("configs/default.yaml"), variant, 0)
  # Seed 0 is the default's seed; the run folder and the shared cache are the grid's own.
  assert grid.config_diff(load_config(f"configs/{variant}.yaml"), got) == []
  for name, buffer in (("ablation_small", 12), ("ablation_tiny", 2)):  # 48 and 8 new tokens
    cfg = grid.run_config(load_config(f"configs/{name}.yaml"), variant, 1)
    assert isinstance(cfg, Config)
    assert cfg.reward.overlong_buffer == (buffer if variant.startswith("dapo") else 0)
    assert cfg.ppo.advantage == ("rloo" if variant.startswith("rloo") else "grpo")
  header = runner._header(load_config("configs/ablation_small.yaml", [f"experiment.variants=[{variant}]"]))
  assert "reward.overlong_buffer=rollout.max_new_tokens/4" in header or not variant.startswith("dapo")


def test_plan_is_seed_major_with_one_folder_per_run_and_the_seed_in_train_and_data(tmp_path):
  cfg = load_config("configs/ablation_tiny.yaml", [f"experiment.dir={tmp_path}", "experiment.seeds=[3, 4]"])
  specs = grid.plan(cfg)
  assert [s.name for s in specs] == ["grpo-s3", "erpo_static-s3", "grpo-s4", "erpo_static-s4"]
  s = specs[3]
  assert s.dir == tmp_path / "runs" / "erpo_static-s4"
  assert (s.cfg.train.seed, s.cfg.data.shuffle_seed) == (4, 4)
  assert s.cfg.erpo.cache_dir == str(tmp_path / "cache")  # one reference cache for the grid
  assert s.cfg.experiment == Config().experiment  # growing the grid leaves a run's config as it was
  assert s.cfg.optim == cfg.optim and s.cfg.eval == cfg.eval


def test_an_existing_run_folder_with_another_config_is_refused_in_one_line(tmp_path):
  cfg = load_config("configs/ablation_tiny.yaml", [f"experiment.dir={tmp_path}"])
  spec = grid.plan(cfg)[0]
  spec.dir.mkdir(parents=True)
  (spec.dir / "config.yaml").write_text(dump_config(spec.cfg))
  grid.check_existing(spec)  # the same config: accepted
  changed = grid.with_overrides(spec.cfg, {"optim.lr": 5e-4, "train.steps": 7})
  (spec.dir / "config.yaml").write_text(dump_config(changed))
  with pytest.raises(UserError) as e:
    grid.check_existing(spec)
  msg = str(e.value)
  assert "\n" not in msg and str(spec.dir) in msg
  assert "optim.lr: 0.0005 -> 0.001" in msg and "train.steps: 7 -> 3" in msg


def test_an_unknown_variant_is_a_config_error_with_the_file_line(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("base: " + str(grid.pathlib.Path("configs/ablation_tiny.yaml").resolve()) +
                  "\nexperiment:\n  variants: [grpo, ppo]\n")
  with pytest.raises(UserError) as e:
    load_config(path)
  assert f"{path}:3" in str(e.value) and "experiment.variants: expected a list of one of 'grpo'" in str(e.value)


# ----------------------------------------------------------------------------- progress


def test_time_left_is_the_mean_time_of_each_phase_times_what_is_not_done(tmp_path):
  path = tmp_path / "progress.jsonl"
  path.write_text("".join(json.dumps({"task": t, "phase": p, "seconds": s}) + "\n"
                          for t, p, s in [("a", "train", 60), ("b", "train", 120), ("a", "eval", 30)]))
  tasks = [("c", "train", False), ("c", "eval", False), ("d", "train", False), ("d", "eval", True),
           ("d", "analyze", False)]
  out = io.StringIO()
  p = Progress(path, tasks, out=out)
  assert p.left(1) == "~1m30s + ? left"  # d train (mean 90 s); d eval done; analyze never timed
  assert p.left(-1) == "~3m30s + ? left"
  p.done(4, "d", "analyze", 10.0)
  assert p.left(1) == "~1m40s left"
  assert out.getvalue().startswith("experiment [5/5] d analyze: done in 0m10s")
  assert json.loads(path.read_text().splitlines()[-1]) == {"task": "d", "phase": "analyze", "seconds": 10.0}


def test_a_run_that_stops_before_its_last_step_stops_the_experiment(tmp_path, monkeypatch):
  trained = []
  monkeypatch.setattr(runner, "_train", trained.append)  # as a SIGTERM'd trainer: returns, no final checkpoint
  cfg = load_config("configs/ablation_tiny.yaml", [f"experiment.dir={tmp_path}", "experiment.base_eval=false",
                                                   "experiment.analyze_num=0"])
  out = io.StringIO()
  assert runner.run_experiment(cfg, out=out) is None
  assert [c.run.dir for c in trained] == [str(tmp_path / "runs" / "grpo-s0")]
  assert out.getvalue().splitlines() == [
      "experiment [1/8] grpo-s0 train: started; time left not known yet",
      "experiment [1/8] grpo-s0 train: stopped before its last step; run the same command to resume"]
  assert not (tmp_path / "report.md").exists()


def test_a_run_still_training_is_left_out_of_the_report_until_its_last_step(tmp_path):
  cfg = load_config("configs/ablation_tiny.yaml", [f"experiment.dir={tmp_path}"])
  specs = grid.plan(cfg)
  assert cfg.train.steps == 3
  for spec, steps in zip(specs, (3, 2)):  # grpo-s0 finished, erpo_static-s0 stopped after step 2
    spec.dir.mkdir(parents=True)
    (spec.dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "reward/mean": 0.1 * i}) + "\n" for i in range(1, steps + 1)))
  runs = runner.load_runs(specs)
  assert [(r.variant, r.seed) for r in runs] == [("grpo", 0)]
  assert [m["step"] for m in runs[0].rows] == [1, 2, 3]

"""Tests of evaluation: the Pass@k / Avg@k estimators, and the sweep on a tiny random model."""

import json
import math

import jax
import numpy as np
import pytest

from erpo_jax.eval import evaluate
from erpo_jax.eval import passk
from erpo_jax.config_io import load_config
from erpo_jax.rollout import sampler as sampler_lib
from erpo_jax.rollout.sampler import Sampler, greedy_reference

# ----------------------------------------------------------------------------- estimators

# (n, c, k): ordinary cases, c = 0, n - c < k, k = n, k = 1, and large n.
CASES = [(1, 0, 1), (1, 1, 1), (5, 0, 3), (5, 2, 3), (5, 3, 3), (10, 0, 10), (10, 1, 10), (32, 1, 1), (32, 5, 8),
         (32, 31, 2), (32, 30, 2), (100, 37, 32), (200, 3, 50), (2, 1, 2), (8, 8, 8), (1000, 10, 500)]


def closed_form(n, c, k):
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_equals_the_binomial_closed_form():
  for n, c, k in CASES:
    assert float(passk.pass_at_k(n, c, k)) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_vectorised_over_problems():
  for k in (1, 2, 3):
    cases = [(n, c) for n, c, kk in CASES if n >= k]
    n_P, c_P = np.array(cases).T
    got_P = passk.pass_at_k(n_P, c_P, k)
    assert got_P.shape == (len(cases),)
    np.testing.assert_allclose(got_P, [closed_form(n, c, k) for n, c in cases], atol=1e-12)


def test_pass_at_k_edge_values():
  assert passk.pass_at_k(10, 0, 4) == 0.0  # nothing correct
  assert passk.pass_at_k(10, 7, 4) == 1.0  # n - c = 3 < k: every draw of 4 holds a correct one
  assert passk.pass_at_k(6, 1, 6) == 1.0  # k = n with one correct
  # 5 samples, 2 correct, k = 3: 1 - C(3,3)/C(5,3) = 1 - 1/10
  assert float(passk.pass_at_k(5, 2, 3)) == pytest.approx(0.9, abs=1e-15)


def test_pass_at_1_is_the_fraction_correct():
  n_P, c_P = np.array([4, 4, 10, 32]), np.array([0, 3, 7, 1])
  np.testing.assert_allclose(passk.pass_at_k(n_P, c_P, 1), c_P / n_P, atol=1e-15)


def test_pass_at_k_grows_with_k_and_stays_in_unit_interval():
  values = [float(passk.pass_at_k(16, 3, k)) for k in range(1, 17)]
  assert all(0.0 <= v <= 1.0 for v in values)
  assert all(a <= b + 1e-15 for a, b in zip(values, values[1:]))
  assert values[-1] == 1.0


def test_pass_at_k_rejects_fewer_samples_than_k_and_bad_counts():
  with pytest.raises(ValueError):
    passk.pass_at_k(3, 1, 4)
  with pytest.raises(ValueError):
    passk.pass_at_k(3, 4, 1)


def test_pass_at_1_is_the_first_samples_accuracy_not_avg_at_k():
  # 3 problems x 2 samples: first samples right, wrong, wrong; Avg@2 = 3/6, Pass@1 = 1/3.
  correct_PxK = np.array([[1, 0], [0, 1], [0, 1]], bool)
  scores = passk.set_scores(correct_PxK, 2)
  assert scores["avg@2"] == pytest.approx(0.5) and scores["pass@1"] == pytest.approx(1 / 3)
  assert scores["pass@2"] == pytest.approx(1.0)


def test_avg_at_k_is_the_mean_of_correct_flags():
  correct_PxK = np.random.default_rng(0).random((7, 5)) < 0.4
  assert float(np.mean(passk.avg_at_k(correct_PxK))) == pytest.approx(correct_PxK.mean(), abs=1e-15)
  scores = passk.set_scores(correct_PxK, 5)
  assert scores["avg@5"] == pytest.approx(correct_PxK.mean(), abs=1e-15)
  assert scores["pass@1"] == pytest.approx(correct_PxK[:, 0].mean(), abs=1e-15)  # one attempt: the first sample
  # k = K: a problem passes iff one of its samples is correct.
  assert scores["pass@5"] == pytest.approx(correct_PxK.any(axis=1).mean(), abs=1e-15)


def hand_results():
  """Two sets x two temperatures, k = 2, with hand-picked rows."""
  row = lambda a, p: {"avg@2": a, "pass@2": p, "pass@1": a, "response_len": 4.0, "truncated": 0.5}
  sets = {"a": {"by_temperature": {"t0.0": row(0.5, 0.5), "t1.0": row(0.25, 0.5)}},
          "b": {"by_temperature": {"t0.0": row(1.0, 1.0), "t1.0": row(0.75, 1.0)}}}
  names = passk.metric_names(2)
  for s in sets.values():
    s["mean"] = passk.mean_of(list(s["by_temperature"].values()), names)
  per_t = {t: passk.mean_of([s["by_temperature"][t] for s in sets.values()], names) for t in ("t0.0", "t1.0")}
  return {"k": 2, "seed": 0, "temperatures": [0.0, 1.0], "max_new_tokens": 8, "sets": sets,
          "mean": {"by_temperature": per_t, "mean": passk.mean_of(list(per_t.values()), names)}}


def test_means_over_temperatures_and_sets_are_unweighted_and_tagged():
  s = passk.scalars(hand_results())
  assert s["eval/a/t1.0/avg@2"] == 0.25
  assert s["eval/a/avg@2"] == pytest.approx((0.5 + 0.25) / 2)
  assert s["eval/mean/t0.0/avg@2"] == pytest.approx((0.5 + 1.0) / 2)
  assert s["eval/mean/avg@2"] == pytest.approx((0.5 + 0.25 + 1.0 + 0.75) / 4)
  assert s["eval/mean/pass@2"] == pytest.approx(0.75)
  table = passk.format_table(hand_results())
  lines = table.splitlines()
  assert lines[1].split() == ["set", "T=0", "T=1", "mean"]
  assert lines[2].split() == ["a", "50.0", "/", "50.0", "25.0", "/", "50.0", "37.5", "/", "50.0"]
  assert lines[4].split()[0] == "mean" and lines[4].split()[-3:] == ["62.5", "/", "75.0"]


def test_in_training_eval_uses_the_eval_temperature_closest_to_rollout():
  assert passk.closest_temperature((0.1, 0.7, 0.9, 1.1), 1.0) == 0.9  # ties: the first
  assert passk.closest_temperature((0.0, 1.5), 1.2) == 1.5
  assert passk.closest_temperature((), 0.6) == 0.6


def test_set_labels_are_short_and_unique():
  assert evaluate.set_labels(["builtin:arithmetic", "data/math500.jsonl", "other/math500.parquet", "x/mean.jsonl"]) \
      == ["arithmetic", "math500", "math500_2", "mean_2"]


# ----------------------------------------------------------------------------- tiny random model

PROBLEMS = [("What is 2+3?", "#### 5"), ("Compute 7 - 4.", "#### 3"), ("What is 6*7?", "#### 42")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """configs/tiny.yaml with a 3-problem JSONL set next to the builtin held-out split, model and tokenizer."""
  from erpo_jax.model.io.loading import load_model

  folder = tmp_path_factory.mktemp("eval")
  path = folder / "toy.jsonl"
  path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
  cfg = load_config("configs/tiny.yaml", [f"eval.sets=[{path}, builtin:arithmetic]", f"run.dir={folder / 'run'}",
                                          "eval.batch_size=2"])
  model, tokenizer = load_model(cfg.model)
  return cfg, model, tokenizer


@pytest.fixture(scope="module")
def sampler(tiny):
  """One eval sampler for the tests below, so each program compiles once."""
  cfg, model, tokenizer = tiny
  return evaluate.make_sampler(model, tokenizer, cfg)


def test_eval_is_deterministic_for_a_seed(tiny, sampler):
  cfg, model, tokenizer = tiny
  run = lambda seed: evaluate.evaluate(model, None, tokenizer, cfg, sets=cfg.eval.sets[:1], temperatures=(1.0,),
                                       k=3, seed=seed, sampler=sampler, keep_responses=True)
  a, b, c = run(7), run(7), run(8)
  cell = lambda r: r["sets"]["toy"]["by_temperature"]["t1.0"]
  assert cell(a)["responses"] == cell(b)["responses"]
  assert cell(a) == cell(b)
  assert len(cell(a)["responses"]) == 3 and all(len(r) == 3 for r in cell(a)["responses"])
  assert cell(a)["responses"] != cell(c)["responses"]  # another seed draws other samples


def test_greedy_eval_equals_the_greedy_sampler_output(tiny, sampler):
  cfg, model, tokenizer = tiny
  res = evaluate.evaluate(model, None, tokenizer, cfg, sets=cfg.eval.sets[:1], temperatures=(0.0,), k=4, seed=0,
                          sampler=sampler, keep_responses=True)
  row = res["sets"]["toy"]["by_temperature"]["t0.0"]
  # One greedy sample per problem, counted k times: every estimate is the greedy accuracy.
  assert row["samples"] == 1 and row["avg@4"] == row["pass@4"] == row["pass@1"]
  got = [r[0] for r in row["responses"]]

  prompts = evaluate.load_eval_sets(cfg, tokenizer, cfg.eval.sets[:1])[0].prompt_tokens
  M = cfg.rollout.max_new_tokens
  sampler = Sampler(model, tokenizer, max_new_tokens=M, temperature=0.0, min_prompt_bucket=16)
  roll = sampler.generate(model, prompts, group_size=1, key=jax.random.key(123))
  tokens = np.asarray(roll.tokens)
  expected = sampler_lib.response_texts(tokens, np.asarray(roll.prompt_len), np.asarray(roll.response_len), tokenizer)
  assert got == expected
  # And the cache-free full-forward argmax, cut after the first EOS.
  ref = []
  for ids in greedy_reference(model, prompts, M):
    cut = next((i + 1 for i, t in enumerate(ids) if t in tokenizer.eos_ids), len(ids))
    ref.append(tokenizer.decode(ids[:cut]))
  assert got == ref


def test_eval_during_training_reports_accuracy_and_compiles_once(tiny):
  from flax import nnx

  cfg, model, tokenizer = tiny
  graphdef, state = nnx.split(model)
  out = evaluate.eval_during_training(state, graphdef, tokenizer, cfg, 1, None)
  assert out["eval/temperature"] == 1.0  # tiny.yaml: rollout.temperature 1.0, eval.temperatures [0, 1]
  assert {"eval/accuracy", "eval/pass@2", "eval/pass@1", "eval/response_len", "eval/truncated",
          "eval/toy/avg@2", "eval/arithmetic/pass@2"} <= set(out)
  assert 0.0 <= out["eval/accuracy"] <= 1.0
  sampler = evaluate._TRAINING_EVALUATOR["entry"]["sampler"]
  traces = sampler.traces
  again = evaluate.eval_during_training(state, graphdef, tokenizer, cfg, 2, None)
  assert sampler.traces == traces  # reused sampler: nothing recompiled
  assert again == out  # same weights, same key


def test_run_eval_writes_json_tensorboard_and_prints_a_table(tiny, capsys):
  cfg, _, _ = tiny
  results = evaluate.run_eval(cfg)
  path = f"{cfg.run.dir}/eval/eval_base.json"
  saved = json.loads(open(path).read())
  assert saved == json.loads(json.dumps(results))
  assert saved["step"] is None and saved["k"] == 2 and saved["temperatures"] == [0.0, 1.0]
  assert set(saved["sets"]) == {"toy", "arithmetic"}
  toy = saved["sets"]["toy"]
  assert toy["problems"] == 3 and set(toy["by_temperature"]) == {"t0.0", "t1.0"}
  assert saved["sets"]["arithmetic"]["problems"] == 4  # eval.max_problems
  for row in [*toy["by_temperature"].values(), toy["mean"], saved["mean"]["mean"]]:
    assert {"avg@2", "pass@2", "pass@1", "response_len", "truncated"} <= set(row)
    assert 0.0 <= row["avg@2"] <= row["pass@2"] <= 1.0
    assert 1.0 <= row["response_len"] <= cfg.rollout.max_new_tokens
  import glob
  assert glob.glob(f"{cfg.run.dir}/tb/events.out.tfevents.*")
  out = capsys.readouterr().out
  assert "Avg@2 / Pass@2 (%)" in out
  table = out[out.index("Avg@2"):].splitlines()
  assert table[1].split() == ["set", "T=0", "T=1", "mean"]
  assert [line.split()[0] for line in table[2:5]] == ["toy", "arithmetic", "mean"]

"""The training loop end to end on the tiny model: metrics, TensorBoard, weights modes, reference modes."""

import json
import pathlib

import jax
import numpy as np
import pytest
import yaml

from erpo_jax.config_io import flatten, load_config
from erpo_jax.metrics import SPEC_SCALARS, read_jsonl, read_tensorboard_scalars
from erpo_jax.train.loop import train


def run(tmp_path, name, *overrides):
  cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path / name}", *overrides])
  last = train(cfg)
  return cfg, last, read_jsonl(tmp_path / name / "metrics.jsonl")


def test_a_run_logs_every_spec_scalar_to_tensorboard_and_jsonl_once_per_step(tmp_path, capsys):
  cfg, last, rows = run(tmp_path, "a", "train.steps=2", "train.eval_every=2", "checkpoint.every=0")
  assert [r["step"] for r in rows] == [1, 2]
  # The first step of an invocation also says how long set-up and compilation took.
  assert rows[0]["time/to_first_step"] > rows[0]["time/step"] > 0 and "time/to_first_step" not in rows[1]
  # What the step cost the kernel: the first step compiles and touches its buffers for the first time.
  assert all(isinstance(r["host/page_faults"], int) and r["host/system_s"] >= 0 for r in rows)
  assert rows[0]["host/page_faults"] > rows[1]["host/page_faults"] >= 0
  first = [line for line in capsys.readouterr().out.splitlines() if "is this run's first" in line]
  assert len(first) == 1 and first[0].startswith("step 1 is this run's first: it ended ")
  compiling = float(first[0].split("; ")[1].split(" s of it XLA compiling")[0])
  assert rows[0]["time/compile"] - 0.05 <= compiling <= rows[0]["time/to_first_step"]
  tb = read_tensorboard_scalars(tmp_path / "a" / "tb")
  missing = [name for name in SPEC_SCALARS if name not in tb]
  assert not missing, missing
  for name in SPEC_SCALARS:
    assert all(np.isfinite(v) for _, v in tb[name]), name
  assert tb["kl/query"][-1][1] == pytest.approx(rows[-1]["kl/query"], rel=1e-6)
  # Both KLs every step, whichever is penalised.
  assert all("kl/query" in r and "kl/policy" in r for r in rows)
  assert (tmp_path / "a" / "checkpoints" / "2").is_dir()  # the last step is always saved


def test_a_step_logs_its_wait_for_the_last_checkpoint_write_and_its_phases_add_up_to_its_time(tmp_path):
  # A save at every step: each later step waits, after its rollout, for the write the step before started.
  _, _, rows = run(tmp_path, "w", "train.steps=3", "checkpoint.every=1")
  phases = ("time/rollout", "time/reward", "time/checkpoint_wait", "time/reference", "time/update")
  for r in rows:
    assert all(r[k] >= 0 for k in phases)
    assert sum(r[k] for k in phases) == pytest.approx(r["time/step"], abs=0.05)
  assert rows[0]["time/checkpoint_wait"] < 0.05  # nothing written before the first step
  # Compiling is timed inside the phases: the first step compiles the rollout and the update (or, where the
  # suite's persistent compilation cache holds them already, loads them: 0.37 s on a 2-core EPYC).
  assert all(0 <= r["time/compile"] <= r["time/step"] for r in rows)
  assert rows[0]["time/compile"] > 0.05 and rows[0]["time/compile"] > 10 * rows[-1]["time/compile"]
  assert sorted(int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir()) == [2, 3]  # keep: 2


@pytest.mark.slow
def test_static_weights_come_from_the_reference_cache(tmp_path):
  cfg, last, rows = run(tmp_path, "s", "train.steps=1", "erpo.weights=static")
  cache = np.load(tmp_path / "s" / "cache" / "reference_cache.npz")
  w = cache["weights"]
  assert w.min() >= 0.0 and w.max() <= 2.0
  nll = cache["nll"]
  np.testing.assert_allclose(w, np.clip(nll.mean() / nll, 0, 2), rtol=1e-5)
  assert w.min() <= rows[0]["weight/mean"] <= w.max()


@pytest.mark.slow
def test_weights_none_gives_unit_weights_and_dynamic_follows_the_current_nll(tmp_path):
  _, _, none = run(tmp_path, "n", "train.steps=1", "erpo.weights=none")
  assert none[0]["weight/min"] == none[0]["weight/max"] == 1.0
  _, _, dyn = run(tmp_path, "d", "train.steps=1", "erpo.weights=dynamic")
  r = dyn[0]
  # w = mean(nll) / nll: its extremes are mean/max and mean/min of the prompt NLLs.
  assert r["weight/min"] == pytest.approx(r["prompt_nll/mean"] / r["prompt_nll/max"], rel=1e-4)
  assert r["weight/max"] == pytest.approx(r["prompt_nll/mean"] / r["prompt_nll/min"], rel=1e-4)


def test_a_cached_reference_run_logs_the_policy_kl_every_policy_kl_every_steps_and_at_the_last(tmp_path):
  _, _, rows = run(tmp_path, "c", "train.steps=3", "erpo.reference=cached", "erpo.kl_on=prompt",
                   "log.policy_kl_every=2", "checkpoint.every=0")
  assert [r["step"] for r in rows if "kl/policy" in r] == [2, 3]
  assert all(r["kl/policy"] >= 0 and "kl/query" in r for r in rows if "kl/policy" in r)


@pytest.mark.slow
def test_cached_reference_gives_the_same_first_step_as_the_reference_forward(tmp_path):
  _, _, fwd = run(tmp_path, "f", "train.steps=1", "erpo.reference=forward", "erpo.alpha=1.0")
  _, _, cached = run(tmp_path, "c", "train.steps=1", "erpo.reference=cached", "erpo.alpha=1.0")
  # At step 1 the policy is the reference: both KLs are zero and the losses agree.
  for key in ("kl/query", "kl/policy", "loss/total", "loss/pg", "reward/mean"):
    assert cached[0][key] == pytest.approx(fwd[0][key], abs=1e-6), key
  assert abs(fwd[0]["kl/query"]) < 1e-6


@pytest.mark.slow
def test_config_is_saved_with_the_run(tmp_path):
  cfg, _, _ = run(tmp_path, "c", "train.steps=1")
  saved = load_config(tmp_path / "c" / "config.yaml")
  assert saved == cfg


def on_the_tiny_model(name, run_dir, *overrides):
  """configs/<name>.yaml with tiny.yaml's model, data, rollout and run-length sections in place of the default's."""
  tiny = yaml.safe_load(pathlib.Path("configs/tiny.yaml").read_text())
  flat = flatten({k: tiny[k] for k in ("model", "data", "rollout", "train", "checkpoint", "log")})
  return load_config(f"configs/{name}.yaml", [f"{k}={json.dumps(v)}" for k, v in flat.items()]
                     + [f"run.dir={run_dir}", *overrides])


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) for name in ("dapo_erpo", "dapo", "rloo", "rloo_erpo")])
def test_rloo_and_dapo_configs_train_and_log_rewards_losses_and_their_metrics(tmp_path, name):
  dapo = name.startswith("dapo")
  # The tiny budget is 8 new tokens: DAPO's buffer is its last quarter.
  cfg = on_the_tiny_model(name, tmp_path / name, "train.steps=2", "checkpoint.every=0", "log.samples_every=0",
                          *(["reward.overlong_buffer=2"] if dapo else []))
  assert cfg.ppo.advantage == ("rloo" if name.startswith("rloo") else "grpo")
  train(cfg)
  rows = read_jsonl(tmp_path / name / "metrics.jsonl")
  tb = read_tensorboard_scalars(tmp_path / name / "tb")
  assert [r["step"] for r in rows] == [1, 2]
  for key in ("reward/mean", "reward/accuracy", "reward/overlong_penalty", "loss/total", "loss/pg",
              "loss/masked_truncated", "kl/query"):
    assert [s for s, _ in tb[key]] == [1, 2], key
    for (_, v), r in zip(tb[key], rows):
      assert np.isfinite(r[key]) and v == pytest.approx(r[key], rel=1e-6, abs=1e-7), key
  for r in rows:
    assert r["loss/masked_truncated"] == 0.0  # DAPO's filtering is off: the soft penalty shapes instead
    # The reward the advantages see is the verifier's (1 correct / 0 wrong) plus the overlong penalty.
    assert r["reward/mean"] == pytest.approx(r["reward/accuracy"] + r["reward/overlong_penalty"], abs=1e-6)
    if dapo:
      # Lengths 7 and 8 of 8 tokens cost 0.5 and 1.0: the mean penalty is at most 0, at least -1.
      assert -1.0 <= r["reward/overlong_penalty"] <= 0.0
      assert r["reward/overlong_penalty"] < 0.0 or r["response/len_max"] <= 6
    else:
      assert r["reward/overlong_penalty"] == 0.0
    if name == "dapo":
      assert r["loss/total"] == pytest.approx(r["loss/pg"], abs=1e-7)  # no KL term


def test_a_checkpoint_written_in_the_background_is_on_disk_before_the_next_update(tmp_path, monkeypatch):
  """The write holds a host copy of the parameters and optimizer state: it must not overlap the update's peak."""
  from erpo_jax.train import checkpoint as ck
  from erpo_jax.train import loop
  events, writers = [], []
  save, wait, build = ck.Checkpointer.save, ck.Checkpointer.wait, loop.train_step.build_train_step

  def spying_save(self, step, **kwargs):
    writers.append(self)
    started = save(self, step, **kwargs)
    events.append(f"save {step}" if started else "no save")
    return started

  def spying_wait(self):
    wait(self)
    events.append("waited")

  def spying_build(*args, **kwargs):
    step_fn = build(*args, **kwargs)

    def step(*a, **k):
      events.append("update" + (" while writing" if any(w._mgr.is_saving_in_progress() for w in writers) else ""))
      return step_fn(*a, **k)
    return step

  monkeypatch.setattr(ck.Checkpointer, "save", spying_save)
  monkeypatch.setattr(ck.Checkpointer, "wait", spying_wait)
  monkeypatch.setattr(loop.train_step, "build_train_step", spying_build)
  run(tmp_path, "a", "train.steps=3", "checkpoint.every=1")
  updates = [i for i, e in enumerate(events) if e.startswith("update")]
  saves = [i for i, e in enumerate(events) if e.startswith("save")]
  assert len(updates) == 3 and len(saves) == 3, events
  assert all(events[u] == "update" for u in updates), events
  for s in saves[:-1]:  # between a save and the next update, a wait that returned
    nxt = min(u for u in updates if u > s)
    assert "waited" in events[s + 1:nxt], events


def test_a_save_reads_the_parameters_and_optimizer_state_once_each(tmp_path, monkeypatch):
  """Finiteness and checksums come from one pass over each tree, inside the save: the loop adds none."""
  from erpo_jax.train import checkpoint_io as cio
  passes, summaries = [], cio.summaries

  def counting(tree):
    passes.append(len(jax.tree.leaves(tree)))
    return summaries(tree)

  monkeypatch.setattr(cio, "summaries", counting)
  run(tmp_path, "a", "train.steps=2", "checkpoint.every=1")
  assert cio.complete_steps(tmp_path / "a" / cio.CHECKPOINTS_DIR) == [1, 2]
  assert len(passes) == 2 * 2, passes  # two saves, two trees each

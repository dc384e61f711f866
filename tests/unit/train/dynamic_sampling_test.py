"""DAPO dynamic sampling: groups without reward spread are dropped and refilled from the data stream, within
a bound; the data order and a resume in the middle of a refill stay exact."""

import dataclasses
import json

import numpy as np
import pytest

import tiny_runs
from erpo_jax.config_io import load_config
from erpo_jax.data.pipeline import PromptBatch
from erpo_jax.metrics import read_jsonl, read_tensorboard_scalars
from erpo_jax.reward.verifier import RewardResult
from erpo_jax.train import dynamic_sampling as ds
from erpo_jax.train.batch import HostRollout
from erpo_jax.train.loop import Hooks, train

G = 4


def _round(first_index: int, spread: list[bool], width: int) -> ds.Drawn:
  """B = len(spread) prompts numbered from first_index; a spread group has rewards [1, 0, 0, 0]."""
  B = len(spread)
  index = np.arange(first_index, first_index + B)
  rewards = np.concatenate([[1.0, 0, 0, 0] if s else [0.0] * G for s in spread]).astype(np.float32)
  row = np.repeat(index, G)
  tokens = np.tile(np.arange(width, dtype=np.int32), (B * G, 1)) + 1000 * row[:, None].astype(np.int32)
  host = HostRollout(tokens=tokens, prompt_mask=np.ones((B * G, width), bool),
                     response_mask=np.zeros((B * G, width), bool), prompt_len=np.full(B * G, width),
                     response_len=np.zeros(B * G, np.int32), truncated=np.zeros(B * G, bool))
  batch = PromptBatch(ids=[f"q{i}" for i in index], prompt_tokens=[[int(i)] for i in index],
                      answers=[str(i) for i in index], texts=[f"prompt {i}" for i in index], index=index,
                      question_masks=[None] * B)
  scored = RewardResult(rewards=rewards, correct=rewards > 0, extracted=[None] * (B * G), timeouts=0, crashes=0)
  return ds.Drawn(batch, host, [f"text {i}" for i in row], scored)


def _stream(pattern: list[list[bool]], widths: list[int]):
  """draw(r) for r >= 1 returns round r of the pattern (round 0 is passed to fill directly)."""
  calls = []

  def draw(r):
    calls.append(r)
    return _round(4 * r, pattern[r], widths[r])
  return _round(0, pattern[0], widths[0]), draw, calls


def test_half_the_groups_without_spread_are_refilled_with_one_extra_round_in_draw_order():
  first, draw, calls = _stream([[True, False, True, False], [False, True, True, False]], [16, 32])
  out, counts, rounds = ds.fill(first, draw, group_size=G, max_extra_rounds=4, pad_id=7)
  assert calls == [1]  # one extra rollout of B = 4 prompts
  assert out.batch.index.tolist() == [0, 2, 5, 6]  # the spread groups, in draw order
  assert counts["sampling/extra_rounds"] == 1 and counts["sampling/extra_prompts"] == 4
  assert counts["sampling/spread_groups"] == 4 and counts["sampling/unfilled_groups"] == 0
  assert out.scored.rewards.reshape(4, G)[:, 0].tolist() == [1, 1, 1, 1]
  # Rows keep their own tokens; the narrower round's rows are padded to the widest round's columns.
  assert out.host.tokens.shape == (16, 32)
  assert (out.host.tokens[:G, 16:] == 7).all() and not out.host.prompt_mask[:G, 16:].any()
  assert out.host.tokens[0, 0] == 0 and out.host.tokens[2 * G, 0] == 5000 and out.host.tokens[3 * G, 31] == 6031
  assert out.texts[2 * G] == "text 5" and out.batch.answers == ["0", "2", "5", "6"]
  m = ds.finalize(counts)
  assert m["sampling/spread_frac"] == pytest.approx(4 / 8)
  assert m["sampling/drawn_reward_mean"] == pytest.approx(4 / 32)


def test_a_full_first_round_draws_nothing_more_and_surplus_spread_groups_are_left_out():
  first, draw, calls = _stream([[True] * 4], [16])
  out, counts, _ = ds.fill(first, draw, group_size=G, max_extra_rounds=4, pad_id=0)
  assert calls == [] and counts["sampling/extra_rounds"] == 0
  assert out.batch.index.tolist() == [0, 1, 2, 3]
  first, draw, calls = _stream([[True, False, False, False], [True, True, True, True]], [16, 16])
  out, _, _ = ds.fill(first, draw, group_size=G, max_extra_rounds=4, pad_id=0)
  assert out.batch.index.tolist() == [0, 4, 5, 6]  # prompt 7 was drawn and sampled but is not trained on


def test_when_the_extra_rounds_run_out_the_batch_is_completed_with_dropped_groups_in_draw_order():
  first, draw, calls = _stream([[False, True, False, False], [False] * 4, [False, False, False, True]], [16] * 3)
  out, counts, _ = ds.fill(first, draw, group_size=G, max_extra_rounds=2, pad_id=0)
  assert calls == [1, 2]
  assert out.batch.index.tolist() == [0, 1, 2, 11]  # spread: 1 and 11; then the first dropped ones, 0 and 2
  assert counts["sampling/unfilled_groups"] == 2 and counts["sampling/extra_prompts"] == 8
  first, draw, calls = _stream([[False] * 4], [16])
  out, counts, _ = ds.fill(first, draw, group_size=G, max_extra_rounds=0, pad_id=0)
  assert calls == [] and out.batch.index.tolist() == [0, 1, 2, 3] and counts["sampling/unfilled_groups"] == 4


def test_all_processes_draw_until_every_one_is_full():
  # This process is full after round 0, another is not: it draws on with them (the collective says no).
  first, draw, calls = _stream([[True] * 4, [True] * 4], [16, 16])
  answers = iter([False, True])
  out, counts, _ = ds.fill(first, draw, group_size=G, max_extra_rounds=4, pad_id=0, all_full=lambda full: next(answers))
  assert calls == [1] and out.batch.index.tolist() == [0, 1, 2, 3] and counts["sampling/extra_rounds"] == 1


# ----------------------------------------------------------------------------- in the training loop


def _half_spread(step, scored):
  """Groups 0 and 1 of every round drawn get rewards [1, 0, 0, 0]; groups 2 and 3 all 0."""
  r = np.zeros_like(scored.rewards).reshape(-1, G)
  r[:2, 0] = 1.0
  return dataclasses.replace(scored, rewards=r.reshape(-1))


def _cfg(tmp_path, name, steps=4):
  return load_config("configs/tiny.yaml", [f"run.dir={tmp_path / name}", "data.batch_size=4", f"train.steps={steps}",
                                           "rollout.dynamic_sampling=true", "log.data_indices=true",
                                           "checkpoint.every=2", "checkpoint.keep=4", "checkpoint.async_save=false"])


def _indices(run_dir):
  return [json.loads(l) for l in (run_dir / "data_indices.process0.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_loop_refills_each_batch_logs_the_extra_rollouts_and_a_resume_mid_refill_is_exact(tmp_path):
  train(_cfg(tmp_path, "full"), hooks=Hooks(scored=_half_spread))
  rows = read_jsonl(tmp_path / "full" / "metrics.jsonl")
  assert [r["sampling/extra_rounds"] for r in rows] == [1, 1, 1, 1]
  assert [r["sampling/extra_prompts"] for r in rows] == [4, 4, 4, 4]
  assert all(r["sampling/spread_frac"] == 0.5 and r["sampling/unfilled_groups"] == 0 for r in rows)
  assert all(r["reward/zero_std_groups"] == 0.0 and r["reward/mean"] == pytest.approx(0.25) for r in rows)
  tb = read_tensorboard_scalars(tmp_path / "full" / "tb")
  assert [v for _, v in tb["sampling/extra_prompts"]] == [4, 4, 4, 4]
  log = _indices(tmp_path / "full")
  for entry in log:  # each step trains groups 0, 1 of its first round and 0, 1 of its refill
    assert entry["index"] == [entry["drawn"][i] for i in (0, 1, 4, 5)] and len(set(entry["drawn"])) == 8

  def crash_in_refill(step, round_):
    if step == 3 and round_ == 1:
      raise KeyboardInterrupt("stopped in the middle of step 3's refill")

  with pytest.raises(KeyboardInterrupt):
    train(_cfg(tmp_path, "resumed"), hooks=Hooks(scored=_half_spread, refill=crash_in_refill))
  assert tiny_runs.complete_steps(tmp_path / "resumed") == [2]
  train(_cfg(tmp_path, "resumed"), hooks=Hooks(scored=_half_spread))
  assert _indices(tmp_path / "resumed") == log  # the same prompts, drawn and trained, as the uninterrupted run
  tiny_runs.assert_bit_equal(tiny_runs.load_item(tmp_path / "resumed"), tiny_runs.load_item(tmp_path / "full"))
  resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
  assert [tiny_runs.deterministic(r) for r in resumed] == [tiny_runs.deterministic(r) for r in rows]

"""Which compiled update program a packed batch runs on (train/programs.py): a larger compiled capacity stands in
for one not compiled yet until the padding it costs adds up to model.compile_after_padding whole-batch updates;
the update it runs is the one of the batch's own capacity, and a resumed run chooses as the uninterrupted one."""

import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import tiny_runs

from erpo_jax.config_io import load_config
from erpo_jax.metrics import read_jsonl
from erpo_jax.train import packing
from erpo_jax.train.loop import Hooks, train
from erpo_jax.train.packing import SplitCapacity
from erpo_jax.train.programs import Programs, fits

sys.path.insert(0, os.path.dirname(__file__))
import forward_only_test as fo  # noqa: E402  (uniform batches, their capacities, one step and its comparison)


G, R, STREAMS = 8, 32, 1
SLOTS = 4 * G * R  # 4 groups of 8: the whole-batch update runs 3 * 1024 forward-slot units


def batch(lengths, uniform_groups=()):
  """4 groups of 8 responses, each group's lengths given; the groups in `uniform_groups` all reward 0."""
  len_N = np.repeat(np.asarray(lengths, np.int32), G)
  rewards_N = np.tile(np.array([1, 0, 0, 0, 0, 0, 0, 0], np.float32), 4)
  for b in uniform_groups:
    rewards_N[b * G:(b + 1) * G] = 0.0
  return len_N, rewards_N


def choose(programs, len_N, rewards_N, prompt_bucket=48):
  needed = packing.capacity_of(len_N, rewards_N, G, STREAMS, R)
  return needed, programs.choose(prompt_bucket, needed, len_N, rewards_N, G, STREAMS, R)


def test_a_smaller_batch_runs_on_a_larger_compiled_capacity_until_its_padding_adds_up_to_the_budget():
  programs = Programs(1.0)
  needed, got = choose(programs, *batch([32, 32, 32, 32]))
  assert needed == got == 1024 and programs.compiled == [(48, 1024)]
  # 640 slots needed: 1024 stands in, 3 * 384 units of padding each time; the budget is 3 * 1024 units.
  assert programs.metrics() == {"perf/padded_share": 0.0, "perf/update_programs": 1.0}
  for padded in (1152, 2304):
    needed, got = choose(programs, *batch([20, 20, 20, 20]))
    assert (needed, got) == (640, 1024) and programs.padded == {(48, 640): padded}
    assert programs.metrics() == {"perf/padded_share": 1 - 640 / 1024, "perf/update_programs": 1.0}
  needed, got = choose(programs, *batch([20, 20, 20, 20]))  # 3456 >= 3072: 640 compiles now
  assert needed == got == 640 and programs.compiled == [(48, 1024), (48, 640)] and programs.padded == {}
  assert programs.metrics() == {"perf/padded_share": 0.0, "perf/update_programs": 2.0}
  assert choose(programs, *batch([20, 20, 20, 20])) == (640, 640)
  # 768 needed: 1024 is the only compiled capacity that holds it.
  assert choose(programs, *batch([24, 24, 24, 24])) == (768, 1024)


def test_a_compiled_capacity_as_cheap_as_the_one_needed_runs_without_counting_padding():
  programs = Programs(1.0)
  first = choose(programs, *batch([32, 32, 32, 32], uniform_groups=[2, 3]))[1]
  assert first == SplitCapacity(1024, 512, 544)
  # 760 tokens, 504 of them trained: more than half of 768, so alone the batch trains all 768 slots (2304 units);
  # the compiled 1024 split in halves holds it for 3 * 512 + 544 = 2080.
  needed, got = choose(programs, *batch([32, 21, 21, 21], uniform_groups=[0]))
  assert needed == 768 and got == first and programs.padded == {} and programs.compiled == [(48, first)]


def test_a_split_program_holds_a_batch_only_where_its_trained_stream_holds_the_rows_it_trains():
  len_N, rewards_N = batch([32, 32, 32, 32], uniform_groups=[2, 3])  # 512 tokens trained, 512 forward-only
  assert fits(SplitCapacity(1024, 512, 544), len_N, rewards_N, G, STREAMS)
  assert not fits(SplitCapacity(1024, 256, 800), len_N, rewards_N, G, STREAMS)
  # A forward-only stream too small for both uniform groups leaves one in the trained stream.
  assert fits(SplitCapacity(1024, 768, 256), len_N, rewards_N, G, STREAMS)
  assert not fits(SplitCapacity(1024, 640, 256), len_N, rewards_N, G, STREAMS)
  assert not fits(SplitCapacity(896, 512, 544), len_N, rewards_N, G, STREAMS)  # the whole batch's 1024 tokens
  assert not fits(SplitCapacity(1024, 512, 544), len_N, None, G, STREAMS)  # no rewards: no split runs
  assert fits(1024, len_N, rewards_N, G, STREAMS) and not fits(896, len_N, rewards_N, G, STREAMS)


@pytest.mark.parametrize("streams", [1, 2])
def test_every_capacity_chosen_holds_every_response_and_the_budget_bounds_each_capacitys_padding(streams):
  rng = np.random.default_rng(streams)
  programs, padded_most, met = Programs(2.0), {}, set()
  for _ in range(400):
    B = 4 * streams
    len_N = np.minimum(rng.integers(1, R + 1, B * G), rng.integers(4, R + 1))
    rewards_N = np.repeat(rng.random(B) < 0.5, G).astype(np.float32)
    rewards_N[rng.random(B * G) < 0.1] = 0.5
    needed = packing.capacity_of(len_N, rewards_N, G, streams, R)
    got = programs.choose(None, needed, len_N, rewards_N, G, streams, R)
    met.add((None, needed))
    assert fits(got, len_N, rewards_N, G, streams) and (None, got) in programs.compiled
    for key, units in programs.padded.items():
      padded_most[key] = max(padded_most.get(key, 0), units)
  assert padded_most and max(padded_most.values()) < 2.0 * 3 * (4 * G * R)
  assert set(programs.compiled) < met  # fewer programs, each one a batch needed


def test_prompt_buckets_do_not_share_programs_and_a_zero_budget_compiles_every_capacity_when_first_met():
  programs = Programs(1.0)
  choose(programs, *batch([32, 32, 32, 32]), prompt_bucket=48)
  assert choose(programs, *batch([20, 20, 20, 20]), prompt_bucket=64) == (640, 640)
  eager = Programs(0.0)
  choose(eager, *batch([32, 32, 32, 32]))
  assert choose(eager, *batch([20, 20, 20, 20])) == (640, 640)


def test_the_state_restores_the_same_choices():
  programs = Programs(1.0)
  for lengths, uniform in (([32] * 4, [1, 2, 3]), ([32] * 4, []), ([20] * 4, []), ([28] * 4, [3])):
    choose(programs, *batch(lengths, uniform))
  state = json.loads(json.dumps(programs.state()))
  restored = Programs(1.0, state)
  assert restored.compiled == programs.compiled and restored.padded == programs.padded
  for lengths, uniform in (([20] * 4, []), ([24] * 4, [0]), ([20] * 4, []), ([16] * 4, [0, 1])):
    assert choose(restored, *batch(lengths, uniform)) == choose(programs, *batch(lengths, uniform))


@pytest.mark.parametrize("stand_in", ["larger split", "whole"])
def test_a_batch_run_on_a_larger_compiled_program_gets_the_update_and_metrics_of_its_own_capacity(stand_in):
  cfg = fo.t.tiny_cfg(*fo.CAPS, "erpo.kl_on=prompt", "erpo.weights=static")
  b = fo.uniform_batch(2, [0])
  own = fo.capacities(b, [0])
  larger = SplitCapacity(own.whole + 16, own.trained + 16, own.forward_only + 8) if stand_in == "larger split" \
      else own.whole + 16
  len_N = np.minimum(np.asarray(b.response_mask).sum(axis=1), fo.R)
  assert fits(larger, len_N, np.asarray(b.rewards), fo.t.G, 1)
  own_metrics, own_params = fo.run(cfg, b, own)
  larger_metrics, larger_params = fo.run(cfg, b, larger)
  for key, value in own_metrics.items():
    assert larger_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
  fo.assert_same_update(cfg, own_params, larger_params)


def _lengths_fall(step, scored):
  """Groups 0 and 1 mixed, 2 and 3 uniform from step 2 on, so that steps need other capacities."""
  r = np.zeros_like(scored.rewards).reshape(4, -1)
  r[0, 0] = r[1, 1] = 1.0
  if step == 1:
    r[2, 0] = r[3, 2] = 1.0
  return dataclasses.replace(scored, rewards=r.reshape(-1))


def _cfg(run_dir, budget):
  return load_config("configs/tiny.yaml", [f"run.dir={run_dir}", "data.batch_size=4", "train.steps=4",
                                           "erpo.reference=cached", f"model.compile_after_padding={budget}",
                                           "checkpoint.every=2", "checkpoint.keep=4", "checkpoint.async_save=false"])


def _programs(run_dir, step):
  return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())["programs"]


@pytest.mark.slow
def test_a_run_resumed_from_a_checkpoint_chooses_the_programs_of_the_uninterrupted_run(tmp_path):
  train(_cfg(tmp_path / "full", 5.0), hooks=Hooks(scored=_lengths_fall))
  full = _programs(tmp_path / "full", 4)
  assert full["padded"], full  # a compiled capacity stood in for one not compiled
  rows = read_jsonl(tmp_path / "full" / "metrics.jsonl")
  assert [r["perf/update_programs"] for r in rows] == [1, 1, 1, 1]
  assert rows[0]["perf/padded_share"] == 0 and all(0 < r["perf/padded_share"] < 0.5 for r in rows[1:])

  def crash(step, scored):
    if step == 3:
      raise KeyboardInterrupt("stopped in step 3")
    return _lengths_fall(step, scored)

  with pytest.raises(KeyboardInterrupt):
    train(_cfg(tmp_path / "resumed", 5.0), hooks=Hooks(scored=crash))
  assert _programs(tmp_path / "resumed", 2) == _programs(tmp_path / "full", 2)
  train(_cfg(tmp_path / "resumed", 5.0), hooks=Hooks(scored=_lengths_fall))
  assert _programs(tmp_path / "resumed", 4) == full
  tiny_runs.assert_bit_equal(tiny_runs.load_item(tmp_path / "resumed"), tiny_runs.load_item(tmp_path / "full"))

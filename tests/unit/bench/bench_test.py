"""The bench: FLOP counts by hand, batch layout, step memory free of the vocabulary, and `bench step` output."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import tiny_runs
from erpo_jax.bench import run as bench_run
from erpo_jax.bench import flops as bench_flops
from erpo_jax.bench import floors as bench_floors
from erpo_jax.bench import rl as bench_rl
from erpo_jax.bench import step as bench_step
from erpo_jax.bench.rollout import NoStopTokens
from erpo_jax.config_io import dump_config, load_config
from erpo_jax.model import llama, lm_head
from erpo_jax.model.io import loading
from erpo_jax.model.config import ModelConfig
from erpo_jax.rollout.sampler import Sampler
from erpo_jax.train import step as train_step

ROOT = str(tiny_runs.REPO)
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
STEP_KEYS = ("name", "variant", "B", "G", "N", "S", "prompt_len_mean", "response_len", "time_s", "tokens_per_s",
             "flops", "flops_per_s", "utilisation", "peak_flops_per_s", "peak_rss_bytes", "temp_bytes",
             "work_flops", "work_flops_per_s", "work_utilisation")

# V=100, D=4, L=1, H=2, K=1, Dh=2, F=8
SMALL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=4, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=2, intermediate_size=8)


def test_flops_match_a_hand_count():
  # Per token, matmul params: q,k,v 4*(2*2 + 2*1*2) = 32, o 2*2*4 = 16, MLP 3*4*8 = 96, lm head 100*4 = 400
  # -> 544, times 2 = 1088; attention 2 * (L * 2 * H * Dh) * ctx = 2 * 8 * ctx = 16 ctx.
  assert SMALL.flops_per_token(5) == 1088 + 16 * 5
  # Forward of 3 rows x 5 positions: 15 * (1088 + 80) = 17520.
  assert bench_flops.forward_flops(SMALL, 3, 5) == 17520
  # Step = 3 forwards for the policy (+1 reference, +1 behaviour pass per extra optimizer step set).
  assert bench_flops.update_passes(reference_forward=True, old_pass=False) == 4
  assert bench_flops.update_passes(reference_forward=False, old_pass=False) == 3
  assert bench_flops.update_passes(reference_forward=True, old_pass=True, epochs=2) == 8
  # Decode: 3 rows over 7 cache slots, 3 * (1088 + 112) = 3600.
  assert bench_flops.decode_step_flops(SMALL, 3, 7) == 3600
  # Prefill: 2 prompts x 4 positions of body (1088 + 64 - 800 = 352) plus one lm head row each:
  # 2 * (4 * 352 + 800) = 4416.
  assert bench_flops.prefill_flops(SMALL, 2, 4) == 4416


def test_rl_work_counts_each_prompt_once_and_each_response_token_by_hand():
  # 2 prompts of 4 tokens, 6 rows of 3 response tokens: 8 + 18 = 26 tokens at context 7, 1088 + 112 = 1200
  # FLOPs each, 31200 per forward; 4 forwards (policy forward and backward, reference).
  assert bench_flops.rl_update_flops(SMALL, prompts=2, rows=6, prompt_len=4, response_len=3, passes=4) == 4 * 31200
  # Rollout: the prefill (2 prompts x 4 positions, 4416) and 2 decode steps of 6 rows over 5 and 6 keys.
  want = 4416 + 6 * (1088 + 80) + 6 * (1088 + 96)
  assert bench_flops.rl_rollout_flops(SMALL, prompts=2, rows=6, prompt_len=4, decode_steps=2) == want


def test_rl_record_gets_the_floors_of_its_update_and_rollout_at_the_matmul_peak():
  cfg = load_config(TINY, ["erpo.reference=forward", "erpo.kl_on=response", "data.batch_size=2",
                           "rollout.group_size=3"])
  rows = [{"step": 1, "prompt/len_mean": 99.0, "response/len_mean": 99.0, "response/len_max": 99},
          {"step": 2, "prompt/len_mean": 4.0, "response/len_mean": 3.0, "response/len_max": 2}]
  work = bench_rl.work_per_step(cfg, SMALL, rows[1:])
  assert work["update_passes"] == 4 and work["update_flops"] == 4 * 31200
  assert work["rollout_flops"] == bench_flops.rl_rollout_flops(SMALL, prompts=2, rows=6, prompt_len=4, decode_steps=2)
  rec = {"name": "rl", "update_s": 2.0, "rollout_s": 1.0, "dtype": "float32", **work}
  bench_floors.with_rl_floors(rec, {"peak_flops_per_s_float32": 124800.0})
  assert rec["update_floor_s"] == 1.0 and rec["update_over_floor"] == 2.0
  assert rec["rollout_floor_s"] == pytest.approx(work["rollout_flops"] / 124800.0)
  assert rec["rollout_over_floor"] == pytest.approx(1.0 / rec["rollout_floor_s"])
  # A cached-reference step has no reference forward, unless it logs the Policy-KL.
  cached = load_config(TINY, ["erpo.reference=cached", "erpo.kl_on=prompt", "data.batch_size=2",
                              "rollout.group_size=3"])
  assert bench_rl.work_per_step(cached, SMALL, rows[1:])["update_flops"] == 3 * 31200
  assert bench_rl.work_per_step(cached, SMALL, [{**rows[1], "kl/policy": 0.1}])["update_flops"] == 4 * 31200
  # One of the two groups uniform: its 3 rows' 9 response tokens run forward only, 2 x 9 x 1200 FLOPs less;
  # a GRPO step (response penalty) or model.forward_only_uniform_groups=false runs them backward.
  half = [{**rows[1], "reward/zero_std_groups": 0.5}]
  assert bench_rl.work_per_step(cached, SMALL, half)["update_flops"] == 3 * 31200 - 2 * 9 * 1200
  assert bench_rl.work_per_step(cfg, SMALL, half)["update_flops"] == 4 * 31200
  off = dataclasses.replace(cached, model=dataclasses.replace(cached.model, forward_only_uniform_groups=False))
  assert bench_rl.work_per_step(off, SMALL, half)["update_flops"] == 3 * 31200
  s = bench_run.summary([{**rec, "step_s": 3.0, "peak_rss_bytes": 1, "peak_children_rss_bytes": 0}])
  assert s["rl_update_over_floor"] == 2.0 and s["rl_rollout_over_floor"] == rec["rollout_over_floor"]


def test_synthetic_batch_is_prompt_then_full_response_with_shared_prompts():
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
  b = bench_step.synthetic_batch(prompts, 2, 4, 12, vocab=50, pad_id=0, seed=1)
  # Row n holds prompt n // G, then M = 4 response tokens, then padding.
  np.testing.assert_array_equal(b["prompt_mask"].sum(1), [3, 3, 5, 5])
  np.testing.assert_array_equal(b["response_mask"].sum(1), [4, 4, 4, 4])
  np.testing.assert_array_equal(b["tokens"][1, :3], [5, 6, 7])
  np.testing.assert_array_equal(b["tokens"][3, :5], [8, 9, 10, 11, 12])
  assert not (b["prompt_mask"] & b["response_mask"]).any()
  assert (b["response_mask"].argmax(1) == b["prompt_mask"].sum(1)).all()  # response starts right after
  assert (b["tokens"][~(b["prompt_mask"] | b["response_mask"])] == 0).all()
  # Reference log-probs only at prompt positions t >= 1, and negative there.
  assert (b["ref_logp"][:, 0] == 0).all() and (b["ref_logp"][b["prompt_mask"] & (np.arange(12) >= 1)] < 0).all()
  # S as the trainer trims it: min(bucket 64 + M 64, 32-multiple >= 53 + 64) = 128; min(16 + 8, 32) = 24.
  assert bench_step.batch_length(np.array([48, 53]), 64, 16) == 128
  assert bench_step.batch_length(np.array([5, 9]), 8, 16) == 24


def test_variant_configs_survive_the_yaml_round_trip_to_a_worker(tmp_path):
  cfg = load_config(TINY)
  for v in bench_run.STEP_VARIANTS:
    want = bench_run.step_variant(cfg, v, None)
    path = tmp_path / f"{v}.yaml"
    path.write_text(dump_config(want))
    assert load_config(path) == want
  assert bench_run.step_variant(cfg, "b", None).erpo.reference == "cached"
  assert bench_run.step_variant(cfg, "c", False).model.shared_prefix is False


def test_variant_e_is_b_with_the_policy_kl_reference_forward_in_every_step_and_only_e_takes_the_reference():
  cfg = load_config(TINY, ["log.policy_kl_every=5"])
  variants = {v: bench_run.step_variant(cfg, v, None) for v in bench_run.STEP_VARIANTS}
  assert variants["e"].erpo == variants["b"].erpo and variants["e"].log.policy_kl_every == 1
  assert variants["b"].log.policy_kl_every == variants["d"].log.policy_kl_every == 0
  assert {v for v, c in variants.items() if train_step.takes_reference(c)} == {"a", "c", "e"}
  # Built and run as the bench does: only (e) of the cached variants logs the Policy-KL, from its own forward.
  model = llama.init_random(llama.model_config_from_random_init(cfg.model.random_init), seed=0)
  prompts = [np.random.default_rng(b).integers(1, 64, 6).tolist() for b in range(cfg.data.batch_size)]
  inp = bench_step.prepare_inputs(cfg, model, prompts, vocab=64, pad_id=0)
  inp.ref_params = jax.tree.map(lambda x: x * 1.01, inp.ref_params)  # a reference the policy is not
  built = {v: bench_step.build_variant(inp, variants[v]) for v in "be"}
  metrics = {v: bench_step.run_once(inp, built[v])[1] for v in "be"}
  assert "kl/policy" not in metrics["b"]
  assert float(metrics["e"]["kl/policy"]) > 0
  # Its work counts the reference forward: one forward pass more than (b)'s forward and backward (3).
  assert bench_step._passes(built["e"]) == bench_step._passes(built["b"]) + 1 == 4


def test_summary_divides_step_times_by_the_grpo_step():
  recs = [{"name": "step/a", "variant": "a", "time_s": 3.0}, {"name": "step/b", "variant": "b", "time_s": 1.0},
          {"name": "step/c", "variant": "c", "time_s": 2.0}, {"name": "step/d", "variant": "d", "time_s": 1.5},
          {"name": "step/e", "variant": "e", "time_s": 2.1},
          {"name": "rl", "step_s": 9.06, "peak_rss_bytes": 5, "peak_children_rss_bytes": 7}]
  s = bench_run.summary(recs)
  assert s["step_a_over_c"] == 1.5 and s["step_b_over_c"] == 0.5 and s["step_d_over_c"] == 0.75
  assert s["step_e_over_c"] == pytest.approx(1.05)
  assert s["rl_step_s"] == 9.06 and s["rl_peak_rss_bytes"] == 7
  assert not any("trl" in k or "peer" in k for k in s)  # no peer figures unless measured and given
  assert s["errors"] == 0


def test_summary_pairs_the_rounds_of_variants_timed_taking_turns():
  # (b) took 0.9x (c)'s time in two rounds of three while the host's speed swung between rounds: the medians'
  # ratio (3.6 / 3.0) says (b) is the slower, the median of the rounds' own ratios says 0.9x.
  recs = [{"name": "step/b/shared_prefix_on", "variant": "b", "shared_prefix": True, "time_s": 3.6,
           "times_s": [1.8, 4.5, 3.6]},
          {"name": "step/c/shared_prefix_on", "variant": "c", "shared_prefix": True, "time_s": 3.0,
           "times_s": [2.0, 5.0, 3.0]},
          {"name": "step/c/shared_prefix_off", "variant": "c", "shared_prefix": False, "time_s": 4.0,
           "times_s": [4.0, 6.0]}]
  s = bench_run.summary(recs)
  assert s["step_b_over_c_shared_prefix_on"] == pytest.approx(1.2)
  assert s["step_b_over_c_shared_prefix_on_paired"] == pytest.approx(0.9)
  assert s["step_c_shared_prefix_speedup"] == pytest.approx(4.0 / 3.0)
  assert "step_c_shared_prefix_speedup_paired" not in s  # rounds of different counts: not one timing
  no_rounds = bench_run.summary([{k: v for k, v in r.items() if k != "times_s"} for r in recs])
  assert "step_b_over_c_shared_prefix_on" in no_rounds and not any(k.endswith("_paired") for k in no_rounds)


def test_rl_floors_use_the_higher_of_the_device_line_and_a_peak_taken_in_the_rl_process_after_its_steps(tmp_path):
  # As every other timed kind: a device line taken in a busy moment must not flatter the floors.
  from erpo_jax.bench import worker
  rec = worker.measure("rl", load_config(TINY, ["data.batch_size=2", "rollout.group_size=2",
                                                "rollout.max_new_tokens=4", f"run.dir={tmp_path}"]),
                       iters=1, warmup=1)
  local = rec["local_peak_flops_per_s"]
  assert local > 0 and rec["update_flops"] > 0 and rec["update_s"] > 0
  assert 0 < rec["local_first_touch_s_per_gib"] < 600
  low = dict(rec)
  bench_floors.with_rl_floors(low, {"peak_flops_per_s_float32": local / 2})
  assert low["peak_source"] == "same process, after the timed runs" and low["peak_flops_per_s"] == local
  assert low["update_floor_s"] == pytest.approx(rec["update_flops"] / local)
  high = dict(rec)
  bench_floors.with_rl_floors(high, {"peak_flops_per_s_float32": local * 2})
  assert high["peak_source"] == "device line" and high["update_floor_s"] == pytest.approx(rec["update_flops"] / local / 2)


def test_the_first_touch_probe_times_fresh_pages_and_scales_the_time_to_a_gibibyte(monkeypatch):
  from erpo_jax.bench import probe as bench_probe
  real = bench_probe.first_touch_s_per_gib()
  assert 0 < real < 600  # seconds per GiB: 0.1-0.3 on bare metal, up to about 11 seen on a VM
  clock = iter([10.0, 10.5])
  monkeypatch.setattr(bench_probe.time, "perf_counter", lambda: next(clock))
  assert bench_probe.first_touch_s_per_gib(64 << 10) == pytest.approx(0.5 * (1 << 30) / (64 << 10))


def test_rl_summary_leaves_out_the_warmup_steps():
  rows = [{"step": 1, "time/step": 30.0, "time/rollout": 20.0, "time/to_first_step": 42.0,
           "host/page_faults": 900000, "host/system_s": 9.0},
          {"step": 2, "time/step": 3.0, "time/rollout": 1.0, "host/page_faults": 10, "host/system_s": 0.5},
          {"step": 3, "time/step": 5.0, "time/rollout": 2.0, "host/page_faults": 30, "host/system_s": 0.1,
           "reward/zero_std_groups": 0.5},
          {"step": 4, "time/step": 4.0, "time/rollout": 3.0, "host/page_faults": 20, "host/system_s": 0.2,
           "reward/zero_std_groups": 1.0}]
  out = bench_rl.summarize_steps(rows, warmup=1)
  assert out["zero_std_groups_mean"] == 0.75
  assert out["step_s"] == 4.0 and out["rollout_s"] == 2.0 and out["timed_steps"] == [2, 3, 4]
  assert out["page_faults_per_step"] == 20 and out["system_s_per_step"] == 0.2
  assert out["warmup_step_times_s"] == [30.0] and out["update_s"] is None
  assert out["to_first_step_s"] == 42.0  # set-up and compilation, apart from the medians


def test_rl_timed_steps_that_compiled_are_listed_and_warned_about():
  rows = [{"step": 1, "time/step": 30.0, "time/compile": 20.0},
          {"step": 2, "time/step": 9.0, "time/compile": 4.5},  # a response capacity first met after the warm-up
          {"step": 3, "time/step": 5.0, "time/compile": 0.0, "perf/padded_share": 0.25},  # on a larger program
          {"step": 4, "time/step": 5.5, "time/compile": 0.05},  # an eager op or two: not worth a word
          {"step": 5, "time/step": 4.0}]  # logged before steps timed their compiling
  out = bench_rl.summarize_steps(rows, warmup=1)
  assert out["compile_s_per_step"] == [4.5, 0.0, 0.05, 0.0]
  assert out["padded_share_per_step"] == [0.0, 0.25, 0.0, 0.0]
  assert bench_rl.compile_warning(out) == (
      "warning: bench rl: 1 of 4 timed steps compiled programs first met there (step 2 4.5 s) and their times "
      "include it; the compilation cache loads them next time: run the bench again, or give it more --warmup steps")
  quiet = bench_rl.summarize_steps([{**r, "time/compile": 0.0} for r in rows], warmup=1)
  assert bench_rl.compile_warning(quiet) is None


def test_sampler_without_stop_tokens_runs_every_row_to_full_length():
  mc = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=8, intermediate_size=32)
  model = llama.init_random(mc, seed=0)
  sampler = Sampler(model, NoStopTokens(pad_id=0), max_new_tokens=6, temperature=1.0, min_prompt_bucket=4)
  roll = sampler.generate(model, [[1, 2, 3], [4, 5]], group_size=3, key=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(roll.response_len), [6] * 6)
  assert np.asarray(roll.truncated).all()  # no row met an EOS


def _step_temp_bytes(vocab: int, *, B: int = 4, G: int = 4, P: int = 16, M: int = 240) -> tuple[int, int]:
  """(XLA scratch bytes of the ERPO step with reference forward, N*S) for the tiny model at this vocab."""
  cfg = load_config(TINY, [f"model.random_init.vocab_size={vocab}", "model.logits_chunk=16",
                           f"data.batch_size={B}", f"rollout.group_size={G}", f"rollout.max_new_tokens={M}"])
  model = llama.init_random(llama.model_config_from_random_init(cfg.model.random_init), seed=0)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, vocab, P).tolist() for _ in range(B)]
  inp = bench_step.prepare_inputs(cfg, model, prompts, vocab=vocab, pad_id=0)
  variant = bench_step.build_variant(inp, cfg)
  return bench_step.compiled_memory(variant.compiled)["temp_bytes"], inp.shape["N"] * inp.shape["S"]


@pytest.mark.slow
def test_step_scratch_memory_grows_with_rows_times_length_and_with_vocab_only_by_the_kept_logits(monkeypatch):
  small_v, big_v = 4096, 65536
  # Materialising [N, S, V] float32 logits would add N*S*(V2 - V1)*4 = 4096 * 61440 * 4 = 1.0 GB of scratch.
  monkeypatch.setattr(lm_head, "KEPT_LOGITS_BYTES", -1)  # every chunk's logits recomputed in the backward
  temp_small, NS = _step_temp_bytes(small_v)
  temp_big, NS_big = _step_temp_bytes(big_v)
  assert NS == NS_big == 16 * 256
  logits_growth = NS * (big_v - small_v) * 4
  # What does grow with V: the [V, D] embedding's gradient and optimizer temporaries, and [C, V] chunks.
  assert temp_big - temp_small < 0.1 * logits_growth, (temp_small, temp_big, logits_growth)
  # The lm-head keeps the chunks' logits for its backward while they fit its bound (1 GiB): no more than that.
  monkeypatch.undo()
  temp_kept, _ = _step_temp_bytes(big_v)
  assert NS * big_v * 4 <= lm_head.KEPT_LOGITS_BYTES and 0.9 * NS * big_v * 4 < temp_kept - temp_big
  assert temp_kept - temp_big < lm_head.KEPT_LOGITS_BYTES + 0.1 * logits_growth, (temp_big, temp_kept)
  # Doubling the rows doubles activations: scratch grows with N*S.
  temp_rows, NS_rows = _step_temp_bytes(small_v, B=8)
  assert NS_rows == 2 * NS and temp_rows > temp_small


def _check_step_lines(lines: list[dict]) -> None:
  names = [r["name"] for r in lines]
  assert names[0] == "device" and names[-1] == "summary"
  assert lines[0]["peak_flops_per_s_float32"] > 0 and lines[0]["read_bytes_per_s"] > 0
  steps = [r for r in lines if r["name"].startswith("step/")]
  assert len(steps) % 4 == 0 and {r["variant"] for r in steps} == {"a", "b", "c", "d"}
  for r in steps:
    for k in STEP_KEYS:
      assert k in r, (r["name"], k)
    for k in ("time_s", "tokens_per_s", "flops", "flops_per_s", "utilisation", "peak_rss_bytes"):
      assert r[k] > 0, (r["name"], k, r[k])
    # tiny.yaml: B=2, G=4, prompts of level-1 questions, M=8.
    assert (r["B"], r["G"], r["N"], r["response_len"]) == (2, 4, 8, 8)
  by = {r["variant"]: r for r in steps}
  assert by["a"]["flops"] == pytest.approx(4 / 3 * by["b"]["flops"], rel=1e-4)  # reference forward = one more
  mc = loading.model_config(load_config(TINY).model)
  for r in steps:  # the update's own work: each prompt once, each row's valid response tokens
    response_len = r["valid_tokens"] / r["N"] - r["prompt_len_mean"]
    passes = round(r["flops"] / bench_flops.forward_flops(mc, r["N"], r["S"]))
    assert r["work_flops"] == pytest.approx(bench_flops.rl_update_flops(
        mc, prompts=r["B"], rows=r["N"], prompt_len=r["prompt_len_mean"], response_len=response_len,
        passes=passes), rel=1e-4)  # records keep 5 significant digits
    assert 0 < r["work_flops"] < r["flops"] and r["work_utilisation"] < r["utilisation"]
  summary = lines[-1]
  assert summary["errors"] == 0
  for k in ("step_a_over_c", "step_b_over_c", "step_d_over_c"):
    assert any(key.startswith(k) and v > 0 for key, v in summary.items()), k


@pytest.mark.slow
def test_run_bench_step_prints_device_four_variants_and_summary(capsys):
  records = bench_run.run_bench(load_config(TINY), what="step", iters=1, warmup=1)
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert len(lines) == len(records) and [r["name"] for r in lines] == [r["name"] for r in records]
  _check_step_lines(lines)


@pytest.mark.slow
def test_cli_bench_step_exits_0_with_json_lines_on_stdout():
  proc = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "bench", "step", "--config", TINY, "--iters", "1",
                         "--warmup", "1"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _check_step_lines([json.loads(line) for line in proc.stdout.splitlines()])


def test_mfu_is_flops_per_s_over_the_data_sheet_bf16_peak_of_the_device_kind():
  device = bench_floors.with_spec_peaks({"device_kind": "NVIDIA H200", "peak_flops_per_s_bfloat16": 700e12})
  assert (device["spec_flops_per_s"], device["spec_bytes_per_s"]) == (989e12, 4.8e12)
  rec = {"dtype": "bfloat16", "flops_per_s": 494.5e12}
  bench_floors.with_utilisation(rec, device, "flops_per_s", "utilisation")
  # 494.5 / 989 = 0.5 of the data sheet; 494.5 / 700 of the measured matmul peak.
  assert rec["mfu"] == pytest.approx(0.5) and rec["utilisation"] == pytest.approx(494.5 / 700)
  # An unknown device has no data-sheet peak unless given; a CPU gets no MFU.
  assert bench_floors.with_spec_peaks({"device_kind": "cpu"})["spec_flops_per_s"] is None
  given = bench_floors.with_spec_peaks({"device_kind": "Some GPU"}, peak_flops=2e14, peak_bandwidth=1e12)
  assert (given["spec_flops_per_s"], given["spec_bytes_per_s"]) == (2e14, 1e12)
  cpu = {"dtype": "float32", "flops_per_s": 1e9}
  bench_floors.with_utilisation(cpu, bench_floors.with_spec_peaks({"device_kind": "cpu"}), "flops_per_s", "utilisation")
  assert "mfu" not in cpu


def test_decode_is_compared_with_the_data_sheet_bandwidth_floor():
  device = bench_floors.with_spec_peaks({"device_kind": "NVIDIA H200 NVL", "read_bytes_per_s": 4.0e12})
  assert device["spec_flops_per_s"] == 835e12  # the longest matching name wins over "NVIDIA H200"
  rec = {"decode_step_s": 5e-3, "param_bytes": 2.0e9, "kv_bytes_per_step": 0.4e9, "decode_step_flops": 1e11}
  bench_floors.with_decode_floors(rec, device)
  # (2.0 + 0.4) GB / 4.8 TB/s = 0.5 ms: a 5 ms token step is 10% of the floor; measured 4.0 TB/s: 0.6 ms, 12%.
  assert rec["decode_spec_bandwidth_floor_s"] == pytest.approx(0.5e-3)
  assert rec["decode_spec_bandwidth_fraction"] == pytest.approx(0.1)
  assert rec["decode_bandwidth_fraction"] == pytest.approx(0.12)


def test_cli_bench_variant_and_peak_options():
  from erpo_jax import cli
  args = cli.parse_args(["bench", "step", "--variants", "c,a", "--shared-prefix", "on", "--peak-flops", "9.89e14"])
  assert (args.variants, args.shared_prefix, args.peak_flops, args.peak_bandwidth) == ("ac", "on", 989e12, None)
  assert cli.parse_args(["bench"]).variants == "abcd"
  assert cli.parse_args(["bench", "step", "--variants", "e,c"]).variants == "ce"
  for bad in (["--variants", "f"], ["--variants", ""], ["--peak-flops", "0"], ["--peak-bandwidth", "inf"]):
    with pytest.raises(SystemExit):
      cli.parse_args(["bench", "step", *bad])


def test_step_runs_only_the_chosen_variants_and_shared_prefix_settings(monkeypatch):
  started = []

  def fake_worker(kind, cfg, *, iters, warmup, tmp):
    cfgs = cfg if isinstance(cfg, list) else [cfg]
    started.append((kind, [(c.erpo.kl_on, c.model.shared_prefix) for c in cfgs]))
    if kind == "steps":
      return {"variants": [{"time_s": 1.0, "flops_per_s": 2.0, "dtype": "float32"} for _ in cfgs],
              "iters": iters, "warmup": warmup, "platform": "cpu", "device_kind": "cpu", "cpu_model": "x",
              "cpu_isa": "AVX2", "xla_max_isa": None, "host_cpus": 2, "local_peak_flops_per_s": 4.0,
              "load_avg_start": [0.0], "load_avg_end": [0.0], "steal_share": 0.0, "compile_cache": {},
              "peak_rss_bytes": 1}
    return {"peak_rss_bytes": 1, "peak_device_bytes": None, "first_call_s": 1.0, "load_avg_end": [0.0]}

  monkeypatch.setattr(bench_run, "run_worker", fake_worker)
  recs = list(bench_run.step_records(load_config(TINY), iters=1, warmup=0, tmp="/tmp", device={},
                                     variants="ac", shared_prefix="on"))
  assert [r["name"] for r in recs] == ["step/a/shared_prefix_on", "step/c/shared_prefix_on"]
  # One timing process for both, then one memory process each.
  assert started == [("steps", [("prompt", True), ("response", True)]), ("step_memory", [("prompt", True)]),
                     ("step_memory", [("response", True)])]
  assert recs[0]["utilisation"] == 0.5  # 2 FLOP/s over the 4 measured in the timing process


def test_reference_record_counts_each_prompts_own_tokens_and_their_packing():
  from erpo_jax.bench.reference import measure_reference
  from erpo_jax.data.pipeline import dataset_prompts
  from erpo_jax.model.io.loading import load_tokenizer
  cfg = load_config(TINY, ["data.size=40"])
  rec = measure_reference(cfg, iters=1, warmup=0, tokens_per_batch=512)
  lengths = [len(t) for t, _ in dataset_prompts(cfg, load_tokenizer(cfg.model))]
  mc = llama.model_config_from_random_init(cfg.model.random_init)
  assert (rec["prompts"], rec["prompt_tokens"], rec["prompt_len_max"]) == (40, sum(lengths), max(lengths))
  assert rec["useful_flops"] == pytest.approx(sum(n * mc.flops_per_token(n) for n in lengths))
  assert rec["flops_per_s"] == pytest.approx(rec["useful_flops"] / rec["time_s"])
  from erpo_jax.data import reference_layout
  R = reference_layout.rows_per_call(rec["rows"], 128, 512)
  assert rec["layout"] == "packed" and rec["row_len"] == 128 and rec["rows_per_call"] == R
  assert rec["calls"] * R >= rec["rows"] > (rec["calls"] - 1) * R
  assert rec["rows"] * 128 >= sum(lengths) and rec["fill"] == pytest.approx(sum(lengths) / (rec["calls"] * R * 128))
  assert rec["first_call_s"] > 0 and len(rec["times_s"]) == 1
  # Like every timing, it carries the host's load and the hypervisor's share of the CPU while it ran.
  assert len(rec["load_avg_start"]) == len(rec["load_avg_end"]) == 3 and 0.0 <= rec["steal_share"] <= 1.0


def test_reference_record_with_a_shared_template_counts_the_prefix_once_and_names_its_layout():
  from erpo_jax.bench import flops as bench_flops
  from erpo_jax.bench.reference import measure_reference
  from erpo_jax.data.pipeline import dataset_prompts
  from erpo_jax.model.io.loading import load_tokenizer
  cfg = load_config(TINY, ["data.size=40", "data.chat_template=true", "data.max_prompt_tokens=64"])
  rec = measure_reference(cfg, iters=1, warmup=0, tokens_per_batch=512)
  lengths = [len(t) for t, _ in dataset_prompts(cfg, load_tokenizer(cfg.model))]
  mc = llama.model_config_from_random_init(cfg.model.random_init)
  plain = sum(n * mc.flops_per_token(n) for n in lengths)
  assert rec["layout"] == "prefix" and rec["prefix_len"] == 24 and rec["streams"] == 1
  assert rec["plain_flops"] == pytest.approx(plain)
  assert rec["useful_flops"] == pytest.approx(plain - 39 * bench_flops.forward_flops(mc, 1, 24))
  assert rec["flops_per_s"] == pytest.approx(rec["useful_flops"] / rec["time_s"])
  assert rec["computed_tokens"] == rec["calls"] * (24 + rec["capacity"])
  needed = rec["calls"] * 24 + sum(lengths) - 40 * 24
  assert rec["fill"] == pytest.approx(needed / rec["computed_tokens"]) and 0.8 < rec["fill"] <= 1.0
  assert rec["computed_tokens"] < 0.5 * sum(lengths)
  off = measure_reference(load_config(TINY, ["data.size=40", "data.chat_template=true", "data.max_prompt_tokens=64",
                                             "model.shared_prefix=false"]), iters=1, warmup=0, tokens_per_batch=512)
  assert off["layout"] == "packed" and off["useful_flops"] == pytest.approx(plain)


@pytest.mark.slow
def test_cli_bench_reference_counts_each_prompts_own_tokens_and_their_packing():
  proc = subprocess.run([sys.executable, "-m", "erpo_jax.cli", "bench", "reference", "--config", TINY, "--iters", "1",
                         "--warmup", "0", "data.size=40"], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
  assert list(lines) == ["device", "reference", "summary"] and lines["summary"]["errors"] == 0
  rec = lines["reference"]
  cfg = load_config(TINY, ["data.size=40"])
  from erpo_jax.data.pipeline import dataset_prompts
  from erpo_jax.model.io.loading import load_tokenizer
  lengths = [len(t) for t, _ in dataset_prompts(cfg, load_tokenizer(cfg.model))]
  mc = llama.model_config_from_random_init(cfg.model.random_init)
  assert (rec["prompts"], rec["prompt_tokens"], rec["prompt_len_max"]) == (40, sum(lengths), max(lengths))
  assert rec["useful_flops"] == pytest.approx(sum(n * mc.flops_per_token(n) for n in lengths), rel=1e-4)
  assert rec["flops_per_s"] == pytest.approx(rec["useful_flops"] / rec["time_s"], rel=1e-3)
  assert rec["row_len"] == 128 and rec["calls"] * rec["rows_per_call"] >= rec["rows"]
  assert rec["fill"] == pytest.approx(sum(lengths) / (rec["calls"] * rec["rows_per_call"] * 128), rel=1e-4)
  assert rec["utilisation"] == pytest.approx(rec["flops_per_s"] / rec["peak_flops_per_s"], rel=1e-3)
  assert lines["summary"]["reference_pass_utilisation"] == pytest.approx(rec["utilisation"], rel=1e-3)

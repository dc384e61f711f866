"""`bench step --profile`: matmul FLOPs per op counted from the compiled HLO, times from the profiler's trace."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

import tiny_runs
from erpo_jax import cli
from erpo_jax.bench import profile
from erpo_jax.bench import run as bench_run
from erpo_jax.bench import step as bench_step
from erpo_jax.config_io import load_config

TINY = os.path.join(str(tiny_runs.REPO), "configs", "tiny.yaml")


def _profile(fn, args, out):
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  return profile.profile_call(lambda: compiled(*args), compiled.as_text(), out)


def test_matmul_flops_of_a_traced_call_equal_a_hand_count(tmp_path):
  k = jax.random.split(jax.random.key(0), 5)
  a, b, c = (jax.random.normal(k[0], (64, 128)), jax.random.normal(k[1], (128, 256)),
             jax.random.normal(k[2], (256, 32)))
  x, y = jax.random.normal(k[3], (4, 16, 32)), jax.random.normal(k[4], (4, 32, 48))

  def fn(a, b, c, x, y):
    return jnp.sum(jnp.tanh(a @ b) @ c) + jnp.sum(jnp.einsum("bij,bjk->bik", x, y))

  got = _profile(fn, (a, b, c, x, y), tmp_path)
  # 2 * out elements * contracted size: [64,256] over 128, [64,32] over 256, [4,16,48] over 32.
  assert got["matmul_flops"] == 2 * 64 * 256 * 128 + 2 * 64 * 32 * 256 + 2 * 4 * 16 * 48 * 32
  assert got["matmul_s"] > 0 and got["wall_s"] > 0 and got["matmul_flops_per_s"] > 0
  saved = json.loads((tmp_path / "ops.json").read_text())
  assert saved["totals"]["matmul_flops"] == got["matmul_flops"]
  seconds = [r["seconds"] for r in saved["ops"]]
  assert seconds == sorted(seconds, reverse=True) and (tmp_path / "ops.txt").read_text().startswith("       ms")


def test_an_op_inside_a_loop_is_counted_once_per_execution(tmp_path):
  h0, w = jnp.ones((64, 64)) * 0.01, jnp.eye(64) * 0.5

  def fn(h, w):
    return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), h)

  got = _profile(fn, (h0, w), tmp_path)
  assert got["matmul_flops"] == 3 * 2 * 64 ** 3
  assert any(r["count"] == 3 and r["flops"] == 3 * 2 * 64 ** 3 for r in
             json.loads((tmp_path / "ops.json").read_text())["ops"])


def test_hlo_dot_flops_follow_fusions_and_skip_unknown_ops():
  text = """HloModule m

%fused_computation (param_0: f32[8,16], param_1: f32[16,4]) -> f32[8,4] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,4]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,4]{1,0} parameter(1)
  %dot.2 = f32[16,16]{1,0} dot(%a, %a), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %fusion.3 = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation, metadata={op_name="x"}
}
"""
  instrs, comps = profile.parse_hlo(text)
  assert profile.op_flops("fusion.3", instrs, comps) == 2 * 8 * 4 * 16
  assert profile.op_flops("dot.2", instrs, comps) == 2 * 16 * 16 * 8
  assert profile.op_flops("a", instrs, comps) == 0 and profile.op_flops("missing", instrs, comps) == 0
  rows = profile.op_table(profile.parse_hlo(text), {"fusion.3": (0.002, 2), "a": (0.001, 1)})
  assert [(r["op"], r["kind"], r["flops"], r["source"]) for r in rows] == [
      ("fusion.3", "matmul", 2 * 2 * 8 * 4 * 16, "x"), ("a", "other", 0.0, "")]
  assert profile.summarise(rows, 0.004)["matmul_share"] == pytest.approx(2 / 3)


def test_a_cublas_gemm_custom_call_counts_its_dot_dimensions():
  text = """ENTRY %main (a: f32[64,32], b: f32[32,16]) -> f32[64,16] {
  %a = f32[64,32]{1,0} parameter(0)
  %b = f32[32,16]{1,0} parameter(1)
  %gemm.1 = (f32[64,16]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", """ \
      """backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":""" \
      """{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],""" \
      """"rhs_batch_dimensions":[]}}}
  ROOT %gte = f32[64,16]{1,0} get-tuple-element(%gemm.1), index=0
}
"""
  instrs, comps = profile.parse_hlo(text)
  assert profile.op_flops("gemm.1", instrs, comps) == 2 * 64 * 16 * 32
  assert profile.op_flops("gte", instrs, comps) == 0


def test_a_profiled_tiny_update_counts_the_matmul_work_of_the_step(tmp_path):
  cfg = bench_run.step_variant(load_config(TINY), "c", False)
  rec = bench_step.profile_step(cfg, str(tmp_path / "c"), warmup=1)
  # Policy forward + backward (3 forwards) and reference forward, counted over all S positions; the step
  # scores S - 1 of them (the last token predicts nothing), and the lm-head chunks recomputed in the backward
  # may add one more lm-head pass (XLA reuses the forward's logits for them when there is only one chunk).
  S = rec["S"]
  assert (S - 1) / S * rec["flops_plain_layout"] <= rec["matmul_flops"] < 1.5 * rec["flops_plain_layout"]
  assert rec["wall_s"] > 0 and rec["ops"] > 10 and len(rec["top"]) == 10
  assert 0 <= rec["side_by_side_s"] <= rec["busy_s"] <= rec["wall_s"] * 1.01
  assert all(r["beside_share"] is None or 0 <= r["beside_share"] <= 1 + 1e-9 for r in rec["top"])
  assert list((tmp_path / "c" / "trace").rglob("*.trace.json.gz"))


def test_cli_profile_needs_the_step_measurement_and_a_writable_folder(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "rollout", "--config", "configs/tiny.yaml", "--profile", str(tmp_path)])
  assert e.value.code == 2 and "use it with bench step or bench all, not rollout" in capsys.readouterr().err
  blocker = tmp_path / "file"
  blocker.write_text("")
  assert cli.main(["bench", "step", "--config", "configs/tiny.yaml", "--profile", str(blocker / "p")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"--profile '{blocker / 'p'}'" in err and "give a folder you can write" in err


def test_side_by_side_counts_the_time_another_leaf_op_ran_beside_each_op():
  text = """ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fusion.1 = f32[8]{0} fusion(%a), kind=kLoop, calls=%f
  %fusion.2 = f32[8]{0} fusion(%a), kind=kLoop, calls=%f
  %fusion.3 = f32[8]{0} fusion(%a), kind=kLoop, calls=%f
  ROOT %while.4 = f32[8]{0} while(%a), condition=%c, body=%b
}
"""
  instrs, _ = profile.parse_hlo(text)
  # fusion.1 [0, 10) twice over: [0, 10) and [30, 34); fusion.2 [5, 15); fusion.3 [12, 14) inside fusion.2;
  # the loop's event spans everything and is not an op beside the others.
  intervals = {"fusion.1": [(0.0, 10.0), (30.0, 4.0)], "fusion.2": [(5.0, 10.0)], "fusion.3": [(12.0, 2.0)],
               "while.4": [(0.0, 40.0)]}
  beside, totals = profile.side_by_side(intervals, instrs)
  assert beside == pytest.approx({"fusion.1": 5.0, "fusion.2": 5.0 + 2.0, "fusion.3": 2.0})
  assert totals == pytest.approx({"busy_s": 15.0 + 4.0, "side_by_side_s": 5.0 + 2.0})
  times = profile.op_times(intervals)
  assert times == {"fusion.1": (14.0, 2), "fusion.2": (10.0, 1), "fusion.3": (2.0, 1), "while.4": (40.0, 1)}
  rows = profile.op_table(profile.parse_hlo(text), times, beside)
  share = {r["op"]: r["beside_share"] for r in rows}
  assert share == pytest.approx({"fusion.1": 5.0 / 14.0, "fusion.2": 0.7, "fusion.3": 1.0, "while.4": None})
  assert "beside" in profile.format_table(rows).splitlines()[0]


def _write_trace(folder, events):
  import gzip
  path = folder / "plugins" / "profile" / "run"
  path.mkdir(parents=True)
  with gzip.open(path / "vm.trace.json.gz", "wt", encoding="utf-8") as f:
    json.dump({"traceEvents": events}, f)


def test_on_a_gpu_trace_only_the_device_stream_events_time_an_op(tmp_path):
  # The host thread launches fusion.1 (a 3 us event of the same name); the kernel runs 40 us on the GPU's stream.
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "X", "pid": 1, "tid": 7, "ts": 10.0, "dur": 3.0, "name": "fusion.1"},
            {"ph": "X", "pid": 2, "tid": 9, "ts": 20.0, "dur": 40.0, "name": "loop_fusion_kernel",
             "args": {"hlo_op": "fusion.1"}},
            {"ph": "X", "pid": 2, "tid": 9, "ts": 70.0, "dur": 5.0, "name": "dot.2"}]
  _write_trace(tmp_path, events)
  got = profile.trace_op_intervals(tmp_path, {"fusion.1", "dot.2"})
  assert got == {"fusion.1": [pytest.approx((20e-6, 40e-6))], "dot.2": [pytest.approx((70e-6, 5e-6))]}


def test_on_a_cpu_trace_the_host_threads_time_the_ops(tmp_path):
  events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "X", "pid": 1, "tid": 7, "ts": 10.0, "dur": 3.0, "name": "fusion.1"}]
  _write_trace(tmp_path, events)
  assert profile.trace_op_intervals(tmp_path, {"fusion.1"}) == {"fusion.1": [pytest.approx((10e-6, 3e-6))]}


def test_ops_above_the_peak_are_named_as_ops_whose_work_ran_outside_their_events():
  rows = [{"op": "ynn_fusion.3", "flops_per_s": 1.1e11, "shape": "f32[49152,576]", "source": "dot_general"},
          {"op": "dot_general.13", "flops_per_s": 1.36e13, "shape": "f32[128,576]", "source": "dot_general"},
          {"op": "exp_fusion", "flops_per_s": None, "shape": "f32[128]", "source": "exp"}]
  got = profile.above_peak(rows, 2.7e11)
  assert got == [{"op": "dot_general.13", "flops_per_s": 1.36e13, "shape": "f32[128,576]", "source": "dot_general"}]
  assert profile.above_peak(rows, 2e13) == []


def test_a_profile_record_with_a_peak_gets_its_ops_above_it_and_one_line_says_so(tmp_path, capsys):
  ops = [{"op": "ynn_fusion.3", "flops_per_s": 1.1e11, "shape": "f32[49152,576]", "source": "dot_general"},
         {"op": "dot_general.13", "flops_per_s": 1.36e13, "shape": "f32[128,576]", "source": "dot_general"}]
  (tmp_path / "ops.json").write_text(json.dumps({"totals": {}, "ops": ops}))
  rec = {"dir": str(tmp_path), "peak_flops_per_s": 2.7e11}
  profile.mark_above_peak(rec, "c/shared_prefix_on")
  assert [o["op"] for o in rec["ops_above_peak"]] == ["dot_general.13"]
  assert "1 op(s) above the matmul peak" in capsys.readouterr().err
  unknown = {"dir": str(tmp_path)}  # no measured peak: nothing to compare with
  profile.mark_above_peak(unknown, "c/shared_prefix_on")
  assert "ops_above_peak" not in unknown


def test_a_loops_own_event_is_not_counted_again_beside_the_ops_of_its_body():
  # A loop's event spans (part of) its body's ops, which are timed themselves: counting it too made `other_s`
  # larger than the time any op ran.
  rows = [{"op": "ynn_fusion.6", "kind": "matmul", "seconds": 0.6, "flops": 1.2e11, "opcode": "fusion"},
          {"op": "exp_fusion", "kind": "other", "seconds": 0.1, "flops": 0, "opcode": "fusion"},
          {"op": "while.47", "kind": "other", "seconds": 0.5, "flops": 0, "opcode": "while"},
          {"op": "call.3", "kind": "other", "seconds": 0.2, "flops": 0, "opcode": "call"}]
  got = profile.summarise(rows, wall_s=0.75)
  assert got["ops_s"] == pytest.approx(0.7) and got["other_s"] == pytest.approx(0.1)
  assert got["matmul_s"] == pytest.approx(0.6) and got["matmul_share"] == pytest.approx(0.6 / 0.7)

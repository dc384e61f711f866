"""Where a jitted program's time goes: one traced call, each XLA op's time, and the matmul FLOPs of each op.

    erpo-jax bench step --config configs/bench_reference.yaml --variants c --shared-prefix on --profile DIR

writes, for each step variant, DIR/<variant>/ with the profiler's trace (`trace/`: open it in Perfetto or
TensorBoard's profile plugin), `ops.json` (every op the trace timed, slowest first), `ops.txt` (the same as a
table) and `program.hlo.txt` (the compiled program, with each op's operands and layouts), and the bench prints
one `profile/...` JSON line: the call's wall time, the time of matmul ops and of the rest, and the matmul FLOP/s
achieved inside the matmul ops.

An op is an instruction of the compiled program (a fusion, a dot, a copy, ...); the trace names each executed op
(XLA's CPU thunks, GPU kernels carry it as `hlo_op`). Its FLOPs are those of the dots it computes, fused or not,
or of the cuBLAS gemm it calls, counted from the shapes in the compiled HLO: 2 x output elements x contracted size.
XLA's CPU runtime runs independent ops side by side on its threads, so op times may add up to more than the wall
time, and an op that shared the cores ran slower than it would alone: each row says what share of its time
another op ran beside it (`beside`), and the totals give the time some op ran (`busy_s`) and the time two or
more did (`side_by_side_s`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import gzip
import json
import math
import os
import pathlib
import re
import shutil
import sys
import time
from typing import Any, Callable

from erpo_jax.errors import PathError

# `%name = f32[2,3]{1,0} op(...)` or `name = (f32[2], s32[]) op(...)`; the shape may be a tuple.
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?|\(.*?\))\s+([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_DIMS = re.compile(r"^\w+\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}]*?)\}?(?:,\s*\w+=|$)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # as printed, e.g. f32[2048,576]{1,0}
  opcode: str
  rest: str  # operands and attributes
  computation: str


def _dims(shape: str) -> list[int] | None:
  m = _DIMS.match(shape)
  return None if m is None else [int(x) for x in m.group(1).split(",") if x]


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict[str, list[str]]]:
  """(instructions by name, instruction names by computation) of an HLO module's text."""
  instrs: dict[str, Instruction] = {}
  comps: dict[str, list[str]] = collections.defaultdict(list)
  current = ""
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m and "=" not in line.split("(")[0]:
      current = m.group(1)
      continue
    m = _INSTR.match(line)
    if m:
      ins = Instruction(m.group(1), m.group(2), m.group(3), m.group(4), current)
      instrs[ins.name] = ins
      comps[current].append(ins.name)
  return instrs, dict(comps)


def _operands(rest: str) -> list[str]:
  """The operand names of an instruction (up to the closing parenthesis of its operand list)."""
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      end = i
      break
  names = []
  for part in rest[:end].split(","):
    part = part.strip()
    if part:
      names.append(part.split(" ")[-1].lstrip("%"))
  return names


def _is_gemm_call(ins: Instruction) -> bool:
  """A library matmul: cuBLAS / cuBLASLt gemm custom-calls on GPU (their dot dimensions in backend_config)."""
  gemm = re.search(r'custom_call_target="__cublas[^"]*(gemm|matmul)', ins.rest)
  return ins.opcode == "custom-call" and gemm is not None


def dot_flops(ins: Instruction, instrs: dict[str, Instruction]) -> float:
  """2 x output elements x contracted elements of one dot (or gemm custom-call); 0 when a shape is unknown."""
  shape = ins.shape.lstrip("(")  # a gemm custom-call returns (result, workspace)
  out = _dims(shape)
  ops = _operands(ins.rest)
  lhs = instrs.get(ops[0]) if ops else None
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
  if m is None:  # backend_config JSON: "lhs_contracting_dimensions":["1"]
    m = re.search(r'"lhs_contracting_dimensions":\[([\d",]*)\]', ins.rest)
  if out is None or lhs is None or m is None or _dims(lhs.shape) is None:
    return 0.0
  lhs_dims = _dims(lhs.shape)
  contracted = math.prod(lhs_dims[int(i.strip('"'))] for i in m.group(1).split(",") if i.strip('"'))
  return 2.0 * math.prod(out) * contracted


def _called(ins: Instruction) -> list[str]:
  out = []
  for m in _CALLS.finditer(ins.rest):
    out += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
  return out


def op_flops(name: str, instrs: dict[str, Instruction], comps: dict[str, list[str]]) -> float:
  """Matmul FLOPs of one execution of op `name`: its own dot, or the dots of the fusion it calls.

  Loops (while) and calls are not followed: their bodies' ops are timed, and counted, as ops of their own.
  """
  ins = instrs.get(name)
  if ins is None:
    return 0.0
  if ins.opcode == "dot" or _is_gemm_call(ins):
    return dot_flops(ins, instrs)
  if ins.opcode != "fusion":
    return 0.0
  total, todo, seen = 0.0, list(_called(ins)), set()
  while todo:
    comp = todo.pop()
    if comp in seen:
      continue
    seen.add(comp)
    for n in comps.get(comp, []):
      sub = instrs[n]
      if sub.opcode == "dot" or _is_gemm_call(sub):
        total += dot_flops(sub, instrs)
      elif sub.opcode == "fusion":
        todo += _called(sub)
  return total


def trace_op_intervals(trace_dir: str | pathlib.Path, op_names: set[str]) -> dict[str, list[tuple[float, float]]]:
  """{op: [(start, duration) in seconds, one per execution]} from the Perfetto trace under trace_dir."""
  files = sorted(glob.glob(str(pathlib.Path(trace_dir) / "**" / "*.trace.json.gz"), recursive=True))
  if not files:
    raise RuntimeError(f"profile: no *.trace.json.gz under {trace_dir}")
  with gzip.open(files[-1], "rt", encoding="utf-8") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  # On an accelerator the host's threads carry launch events that may share an op's name: count only the
  # device's own events (processes named /device:GPU:0, /device:TPU:0, ...) where the trace has any.
  devices = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
             and str((e.get("args") or {}).get("name", "")).startswith("/device:")}
  out: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
  for e in events:
    if e.get("ph") != "X" or (devices and e.get("pid") not in devices):
      continue
    name = e.get("name", "")
    if name not in op_names:
      name = (e.get("args") or {}).get("hlo_op", name)
    if name in op_names:
      out[name].append((float(e.get("ts", 0.0)) * 1e-6, float(e.get("dur", 0.0)) * 1e-6))
  return dict(out)


def op_times(intervals: dict[str, list[tuple[float, float]]]) -> dict[str, tuple[float, int]]:
  """{op: (seconds, executions)} of trace_op_intervals' {op: [(start, duration), ...]}."""
  return {k: (sum(d for _, d in v), len(v)) for k, v in intervals.items()}


# Ops that hold other ops: a loop's or call's event spans the ops of its body.
_CONTAINERS = {"while", "call", "conditional"}


def side_by_side(intervals: dict[str, list[tuple[float, float]]], instrs: dict[str, Instruction]
                 ) -> tuple[dict[str, float], dict[str, float]]:
  """({op: seconds another op ran beside it}, {"busy_s", "side_by_side_s"}) over the leaf ops (not loops or calls).

  XLA's CPU runtime runs independent ops of a program at the same time on its threads, and each then gets part
  of the cores: an op's time alone is not its speed when another ran beside it. busy_s: time at least one op
  ran; side_by_side_s: time two or more did.
  """
  leaf = {k: v for k, v in intervals.items() if getattr(instrs.get(k), "opcode", "") not in _CONTAINERS}
  edges = sorted([(s, 1) for v in leaf.values() for s, _ in v] + [(s + d, -1) for v in leaf.values() for s, d in v])
  # After each edge: its time, the number of ops running, and the time with two or more running so far.
  times, running_after, crowded_upto, running, busy, crowded = [], [], [], 0, 0.0, 0.0
  for t, step in edges:
    if times:
      gap = t - times[-1]
      busy += gap if running >= 1 else 0.0
      crowded += gap if running >= 2 else 0.0
    running += step
    times.append(t)
    running_after.append(running)
    crowded_upto.append(crowded)

  def crowded_at(t: float) -> float:
    """Time with two or more ops running, from the first edge to t."""
    i = bisect.bisect_right(times, t) - 1
    if i < 0:
      return 0.0
    return crowded_upto[i] + ((t - times[i]) if running_after[i] >= 2 else 0.0)

  shared = {k: sum(crowded_at(s + d) - crowded_at(s) for s, d in v) for k, v in leaf.items()}
  return shared, {"busy_s": busy, "side_by_side_s": crowded}


def op_table(parsed, times: dict[str, tuple[float, int]], beside: dict[str, float] | None = None
             ) -> list[dict[str, Any]]:
  """One row per timed op of parse_hlo's (instructions, computations), slowest first: seconds, executions,
  matmul FLOPs, FLOP/s, shape and source op; with side_by_side()'s `beside`, also the share of the op's time
  that another op ran beside it (`beside_share`, None for loops and calls)."""
  instrs, comps = parsed
  rows = []
  for name, (seconds, count) in times.items():
    ins = instrs[name]
    flops = op_flops(name, instrs, comps) * count
    src = _OP_NAME.search(ins.rest)
    shared = None if beside is None or name not in beside else (beside[name] / seconds if seconds > 0 else 0.0)
    rows.append({"op": name, "kind": "matmul" if flops else "other", "seconds": seconds, "count": count,
                 "flops": flops, "flops_per_s": flops / seconds if flops and seconds > 0 else None,
                 "beside_share": shared,
                 "shape": ins.shape.split("{")[0], "opcode": ins.opcode, "source": src.group(1) if src else ""})
  rows.sort(key=lambda r: -r["seconds"])
  return rows


def above_peak(rows: list[dict[str, Any]], peak_flops_per_s: float) -> list[dict[str, Any]]:
  """The op table's matmul ops whose FLOP/s exceed the peak: their work ran outside their own trace event (as
  XLA's CPU Eigen dots do), so the ops whose events ran meanwhile took up its time and look slower than they
  are. Each as {op, flops_per_s, shape, source}."""
  return [{k: r[k] for k in ("op", "flops_per_s", "shape", "source")} for r in rows
          if r.get("flops_per_s") and r["flops_per_s"] > peak_flops_per_s]


def mark_above_peak(rec: dict[str, Any], tag: str) -> None:
  """Adds `ops_above_peak` (from the folder's ops.json) to a `profile/...` record that has a peak
  (`peak_flops_per_s`); one line on stderr names them when there are any."""
  if not rec.get("peak_flops_per_s"):
    return
  with open(os.path.join(rec["dir"], "ops.json")) as f:
    rec["ops_above_peak"] = above_peak(json.load(f)["ops"], rec["peak_flops_per_s"])
  if rec["ops_above_peak"]:
    print(f"bench profile {tag}: {len(rec['ops_above_peak'])} op(s) above the matmul peak, their work outside "
          f"their trace events (the ops beside them look slower than they are): "
          f"{', '.join(o['op'] for o in rec['ops_above_peak'][:5])}", file=sys.stderr, flush=True)


def summarise(rows: list[dict[str, Any]], wall_s: float, overlap: dict[str, float] | None = None
              ) -> dict[str, Any]:
  """Totals over the op table: time in matmul ops and in the rest, matmul FLOPs and their rate; with
  side_by_side()'s totals, the time some op ran (`busy_s`) and the time two or more ran (`side_by_side_s`).
  Loops and calls are left out of the times: their events span ops of their bodies, timed themselves."""
  mm = [r for r in rows if r["kind"] == "matmul"]
  matmul_s = sum(r["seconds"] for r in mm)
  flops = sum(r["flops"] for r in mm)
  ops_s = sum(r["seconds"] for r in rows if r.get("opcode") not in _CONTAINERS)
  return {"wall_s": wall_s, "ops_s": ops_s, "matmul_s": matmul_s, "other_s": ops_s - matmul_s,
          "matmul_share": matmul_s / ops_s if ops_s else None, "matmul_flops": flops,
          "matmul_flops_per_s": flops / matmul_s if matmul_s else None,
          "flops_per_wall_s": flops / wall_s if wall_s else None, "ops": len(rows), **(overlap or {})}


def format_table(rows: list[dict[str, Any]], top: int = 30) -> str:
  lines = [f"{'ms':>9} {'count':>6} {'GFLOP':>8} {'GFLOP/s':>8} {'beside':>6}  {'op':28} {'shape':26} source"]
  for r in rows[:top]:
    rate = f"{r['flops_per_s'] / 1e9:8.1f}" if r["flops_per_s"] else f"{'':8}"
    shared = f"{r['beside_share']:6.0%}" if r.get("beside_share") is not None else f"{'':6}"
    lines.append(f"{r['seconds'] * 1e3:9.1f} {r['count']:6d} {r['flops'] / 1e9:8.2f} {rate} {shared}  {r['op'][:28]:28} "
                 f"{r['shape'][:26]:26} {r['source'][-70:]}")
  return "\n".join(lines)


def make_folder(path: str) -> None:
  """Creates the --profile folder, or raises a one-line PathError naming it."""
  try:
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise PathError(f"--profile '{path}': {e.strerror or e}; give a folder you can write") from None
  if not os.access(path, os.W_OK):
    raise PathError(f"--profile '{path}': not writable; give a folder you can write")


def profile_call(run: Callable[[], Any], hlo_text: str, out_dir: str | pathlib.Path) -> dict[str, Any]:
  """Traces one call of `run` (already compiled and warmed up), writes trace/, ops.json and ops.txt into
  out_dir, and returns summarise()'s totals with the ten slowest ops."""
  import jax  # here: the bench's parent process reads op tables (above_peak) without starting jax
  out = pathlib.Path(out_dir)
  trace_dir = out / "trace"
  shutil.rmtree(trace_dir, ignore_errors=True)
  out.mkdir(parents=True, exist_ok=True)
  jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
  try:
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    wall = time.perf_counter() - t0
  finally:
    jax.profiler.stop_trace()
  parsed = parse_hlo(hlo_text)
  intervals = trace_op_intervals(trace_dir, set(parsed[0]))
  beside, overlap = side_by_side(intervals, parsed[0])
  rows = op_table(parsed, op_times(intervals), beside)
  totals = summarise(rows, wall, overlap)
  (out / "ops.json").write_text(json.dumps({"totals": totals, "ops": rows}, indent=1) + "\n")
  (out / "ops.txt").write_text(format_table(rows, top=len(rows)) + "\n")
  (out / "program.hlo.txt").write_text(hlo_text)  # the compiled program the op names refer to
  return {**totals, "dir": str(out),
          "top": [{k: r[k] for k in ("op", "seconds", "count", "flops_per_s", "beside_share", "shape", "source")}
                  for r in rows[:10]]}

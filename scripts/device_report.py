"""The report of scripts/device_check.sh: key figures of each phase from the files under OUT.

    python scripts/device_report.py OUT     # writes OUT/report.md and OUT/report.json, prints the report

Reads summary.txt (phase verdicts), tests.xml (JUnit), <phase>.jsonl (bench records: the `device` line,
`step/...`, `rollout/sampler`, `rl`). The MFU is the update's FLOP/s over the device's data-sheet dense
bfloat16 peak (erpo_jax/bench/machine.py); decode is compared with the memory-bandwidth floor (weights plus
the live KV cache read once per token step, over the data-sheet bandwidth). Imports nothing of erpo_jax, so a
partial run on a broken install still gets its report.
"""

from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET

BENCH_PHASES = ("big_step", "big_profile", "big_ab", "big_rollout", "ref_rl", "ref_rollout", "ref_step")


def read_records(path: pathlib.Path) -> list[dict]:
  """The JSON lines of a bench phase; lines cut short by a timeout are left out."""
  if not path.exists():
    return []
  records = []
  for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
    try:
      rec = json.loads(line)
    except ValueError:
      continue
    if isinstance(rec, dict):
      records.append(rec)
  return records


def read_tests(path: pathlib.Path) -> dict | None:
  """{tests, failures, errors, skipped, failed: [test ids]} of a JUnit file; None when absent or unreadable."""
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError):
    return None
  suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
  out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
  out["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
                   if case.find("failure") is not None or case.find("error") is not None]
  return out


def _pct(x) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x, unit: str = "", scale: float = 1.0, digits: int = 3) -> str:
  return "n/a" if x is None else f"{x / scale:.{digits}g}{unit}"


def _named(records: list[dict], prefix: str, lines: list[str]):
  """The records whose name starts with prefix; an error record becomes one line of `lines` instead."""
  for r in records:
    if not r.get("name", "").startswith(prefix):
      continue
    if "error" in r:
      lines.append(f"{r['name']}: error: {r['error']}")
      continue
    yield r


def step_lines(records: list[dict]) -> list[str]:
  lines = []
  for r in _named(records, "step/", lines):
    lines.append(
        f"{r['name']} ({r.get('label')}, N={r.get('N')} x S={r.get('S')}, {r.get('dtype')}, lm-head chunk "
        f"{r.get('logits_chunk')} tokens, remat {r.get('remat')}): "
        f"{_num(r.get('time_s'), ' s')} per update, {_num(r.get('flops_per_s'), ' TFLOP/s', 1e12)} plain-layout "
        f"equivalent; MFU {_pct(r.get('mfu'))} of {_num(r.get('spec_flops_per_s'), ' TFLOP/s', 1e12)} (data sheet, "
        f"bf16 dense); {_pct(r.get('utilisation'))} of the measured matmul peak "
        f"{_num(r.get('peak_flops_per_s'), ' TFLOP/s', 1e12)}; of the update's own work (each prompt once): "
        f"{_num(r.get('work_flops_per_s'), ' TFLOP/s', 1e12)}, MFU {_pct(r.get('work_mfu'))}; "
        f"compiled in {_num(r.get('compile_s'), ' s')}; peak device memory "
        f"{_num(r.get('peak_device_bytes'), ' GB', 1e9)}")
  return lines


def profile_lines(records: list[dict]) -> list[str]:
  """A traced update (`bench step --profile`): where its time went, and its ten slowest ops."""
  lines = []
  for r in _named(records, "profile/", lines):
    lines.append(
        f"{r['name']}: traced update {_num(r.get('wall_s'), ' s')}; ops {_num(r.get('ops_s'), ' s')} in all "
        f"({r.get('ops')} ops; some op ran {_num(r.get('busy_s'), ' s')}): matmul ops "
        f"{_num(r.get('matmul_s'), ' s')} "
        f"at {_num(r.get('matmul_flops_per_s'), ' TFLOP/s', 1e12)} ({_pct(r.get('matmul_utilisation'))} of the "
        f"measured matmul peak), other ops {_num(r.get('other_s'), ' s')}; every op: {r.get('dir')}/ops.txt")
    for t in r.get("top") or []:
      rate = t.get("flops_per_s")
      lines.append(f"slow op: {_num(t.get('seconds'), ' ms', 1e-3)} x{t.get('count')} {t.get('op')} "
                   f"{t.get('shape')}{f' at {rate / 1e12:.3g} TFLOP/s' if rate else ''} ({str(t.get('source'))[-90:]})")
    for t in r.get("ops_above_peak") or []:
      lines.append(f"above the peak (its work ran outside its trace event): {t.get('op')} {t.get('shape')} at "
                   f"{_num(t.get('flops_per_s'), ' TFLOP/s', 1e12)}")
  return lines


def rollout_lines(records: list[dict]) -> list[str]:
  lines = []
  for r in records:
    if r.get("name") == "rollout/sampler":
      if "error" in r:
        lines.append(f"rollout/sampler: error: {r['error']}")
        continue
      lines.append(
          f"decode: {_num(r.get('decode_tokens_per_s'), ' tokens/s')} ({r.get('N')} rows, "
          f"{_num(r.get('decode_step_s'), ' ms', 1e-3)} per token step); memory-bandwidth floor "
          f"{_num(r.get('decode_spec_bandwidth_floor_s'), ' ms', 1e-3)} at "
          f"{_num(r.get('spec_bytes_per_s'), ' TB/s', 1e12)} (data sheet): {_pct(r.get('decode_spec_bandwidth_fraction'))}"
          f" of it; {_pct(r.get('decode_bandwidth_fraction'))} of the floor at the measured "
          f"{_num(r.get('read_bytes_per_s'), ' TB/s', 1e12)}; decode MFU {_pct(r.get('decode_mfu'))}")
      lines.append(f"prefill: {_num(r.get('prefill_tokens_per_s'), ' tokens/s')}, MFU {_pct(r.get('prefill_mfu'))}")
    if r.get("name") == "rollout/greedy_uncached" and "cache_speedup" in r:
      lines.append(f"KV cache vs the uncached greedy loop: {_num(r['cache_speedup'], 'x')}")
  return lines


def rl_lines(records: list[dict]) -> list[str]:
  lines = []
  for r in records:
    if r.get("name") != "rl":
      continue
    if "error" in r:
      lines.append(f"rl: error: {r['error']}")
      continue
    cache = r.get("compile_cache") or {}
    lines.append(
        f"rl: median step {_num(r.get('step_s'), ' s')} (rollout {_num(r.get('rollout_s'), ' s')}, update "
        f"{_num(r.get('update_s'), ' s')}) over steps {r.get('timed_steps')}; first step ended "
        f"{_num(r.get('to_first_step_s'), ' s')} after start ({cache.get('hits')} of {cache.get('requests')} "
        f"programs from the compilation cache); peak RSS {_num(r.get('peak_rss_bytes'), ' GB', 1e9)}, device "
        f"{_num(r.get('peak_device_bytes'), ' GB', 1e9)}")
  return lines


def device_line(records: list[dict]) -> str | None:
  for r in records:
    if r.get("name") == "device" and "error" not in r:
      return (f"device: {r.get('device_count')} x {r.get('device_kind')} ({r.get('platform')}), host "
              f"{r.get('cpu_model')}; matmul peak measured {_num(r.get('peak_flops_per_s_bfloat16'), ' TFLOP/s', 1e12)}"
              f" bf16, {_num(r.get('peak_flops_per_s_float32'), ' TFLOP/s', 1e12)} f32; read "
              f"{_num(r.get('read_bytes_per_s'), ' TB/s', 1e12)}; data sheet "
              f"{_num(r.get('spec_flops_per_s'), ' TFLOP/s', 1e12)} bf16, {_num(r.get('spec_bytes_per_s'), ' TB/s', 1e12)}")
  return None


def report(out: pathlib.Path) -> tuple[str, dict]:
  """(markdown, a JSON-able digest) of what the phases left in `out`."""
  md = ["# Device check", ""]
  digest: dict = {"phases": {}, "tests": None}
  summary = out / "summary.txt"
  if summary.exists():
    md += ["## Phases", "", "```", summary.read_text(encoding="utf-8", errors="replace").rstrip(), "```", ""]
  env = out / "env.txt"
  if env.exists():
    md += ["## Machine", "", "```", env.read_text(encoding="utf-8", errors="replace").rstrip(), "```", ""]
  tests = read_tests(out / "tests.xml")
  digest["tests"] = tests
  if tests is not None:
    md += ["## Tests", "", f"{tests['tests']} tests: {tests['failures']} failed, {tests['errors']} errors, "
           f"{tests['skipped']} skipped", *[f"- FAILED {t}" for t in tests["failed"]], ""]
  for phase in BENCH_PHASES:
    records = read_records(out / f"{phase}.jsonl")
    if not records:
      continue
    lines = [x for x in [device_line(records)] if x] + step_lines(records) + profile_lines(records) + rollout_lines(records) + rl_lines(records)
    md += [f"## {phase}", "", *[f"- {x}" for x in lines], ""]
    digest["phases"][phase] = {
        "lines": lines,
        "mfu": {r["name"]: r.get("mfu") for r in records if r.get("name", "").startswith("step/")},
        "work_mfu": {r["name"]: r.get("work_mfu") for r in records if r.get("name", "").startswith("step/")},
        "decode": {k: r.get(k) for r in records if r.get("name") == "rollout/sampler"
                   for k in ("decode_tokens_per_s", "decode_step_s", "decode_spec_bandwidth_fraction",
                             "decode_bandwidth_fraction")},
        "rl": {k: r.get(k) for r in records if r.get("name") == "rl"
               for k in ("step_s", "rollout_s", "update_s", "to_first_step_s")},
    }
  return "\n".join(md) + "\n", digest


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print("usage: python scripts/device_report.py OUT", file=sys.stderr)
    return 2
  out = pathlib.Path(argv[0])
  md, digest = report(out)
  (out / "report.md").write_text(md, encoding="utf-8")
  (out / "report.json").write_text(json.dumps(digest, indent=1), encoding="utf-8")
  print(md, end="")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

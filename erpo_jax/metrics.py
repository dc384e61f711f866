"""Run metrics: TensorBoard scalars and text, metrics.jsonl, a console progress bar, and readers for both files."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import pathlib
import struct
import time

import numpy as np
import tqdm
from tensorboardX import SummaryWriter
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

from erpo_jax.errors import PathError, write_error

# A skipped update's NaN loss is written on purpose and the trainer names its step in one line; tensorboardX
# would add a WARNING on stderr for every such scalar.
logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

METRICS_FILE = "metrics.jsonl"  # <run.dir>/metrics.jsonl: one {"step": k, ...} object per line
TB_DIR = "tb"  # <run.dir>/tb

# Every scalar SPEC.md's "Metrics every run logs" asks for, under the names the trainer writes.
SPEC_SCALARS = (
    "kl/query",  # Query-KL: mean k3 over prompt tokens (logged whichever KL is penalised)
    "kl/policy",  # Policy-KL: mean k3 over response tokens
    "kl/clamped_frac",  # fraction of tokens whose estimator hit erpo.kl_max
    "reward/mean",  # of the reward the advantages see (verifier reward + overlong penalty)
    "reward/std",
    "reward/accuracy",  # fraction of responses judged correct
    "reward/overlong_penalty",  # mean DAPO overlong penalty over rows (0 when reward.overlong_buffer = 0)
    "reward/zero_std_groups",  # fraction of groups whose G rewards are all equal
    "entropy/mean",  # mean next-token entropy over response tokens (nats)
    "loss/pg",
    "loss/kl",  # the KL term before alpha (the penalised side: erpo.kl_on)
    "loss/total",
    "loss/masked_truncated",  # fraction of rows ppo.mask_truncated leaves out of the loss
    "clip/low",  # fraction of response tokens clipped at 1 - eps_low
    "clip/high",  # ... at 1 + eps_high
    "clip/dual",  # ... by the dual clip c
    "ratio/mean",  # pi / pi_old over response tokens
    "ratio/min",
    "ratio/max",
    "weight/mean",  # question weights w(q)
    "weight/min",
    "weight/max",
    "prompt_nll/mean",  # per-prompt mean token NLL under the policy
    "prompt_nll/min",
    "prompt_nll/max",
    "prompt/len_mean",  # tokens, with the chat template
    "response/len_mean",  # tokens
    "response/len_max",
    "response/truncated",  # fraction of responses that hit max_new_tokens
    "optim/grad_norm",  # global norm before clipping
    "optim/lr",
    "perf/tokens_per_s",  # prompt + response tokens processed per second
    "time/rollout",  # seconds per step in each phase
    "time/reward",
    "time/reference",
    "time/checkpoint_wait",  # for the previous checkpoint's background write to end, before the update
    "time/update",
    "time/compile",  # of those, compiling programs first met in the step with XLA (or loading them from the cache)
    "host/page_faults",  # minor page faults of the trainer process during the step (all threads)
    "host/system_s",  # CPU seconds the kernel spent for the trainer process during the step
    "eval/gap",  # train accuracy - eval accuracy, on steps where eval runs
)

# Progress-bar fields: (metric, short label, format).
_PROGRESS = (("reward/mean", "reward", "{:.3f}"), ("kl/query", "qkl", "{:.2e}"),
             ("perf/tokens_per_s", "tok/s", "{:.0f}"), ("reward/verifier_timeout_rate", "timeouts", "{:.1%}"))


class MetricsWriter:
  """Writes each step's scalars to TensorBoard, metrics.jsonl and a progress bar (process 0 only).

  Starting after step k (`start_step=k`, 0 for a fresh run) drops
  metrics.jsonl lines with step > k, written after the last checkpoint by a
  run that then crashed, so the file holds each step once; TensorBoard is told
  to purge steps > k.
  """

  def __init__(self, run_dir, *, tensorboard: bool = True, progress: bool = True, total_steps: int,
               start_step: int = 0, is_main: bool = True):
    self.is_main = is_main
    self._tb = None
    self._bar = None
    self._jsonl = None
    if not is_main:
      return
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / METRICS_FILE
    try:
      truncate_jsonl(path, start_step)
      self._jsonl = open(path, "a", encoding="utf-8")
    except OSError as e:
      raise write_error(path, e) from None
    if tensorboard:
      # purge_step: TensorBoard hides earlier files' events at steps > start_step, as metrics.jsonl drops
      # them. tensorboardX writes from a background thread and reaches the disk every flush_secs. The
      # suffix keeps a resumed run from truncating an event file named in the same second.
      try:
        self._tb = SummaryWriter(str(run_dir / TB_DIR), purge_step=start_step + 1, flush_secs=10,
                                 filename_suffix=f".{time.time_ns()}")
      except OSError as e:
        raise write_error(run_dir / TB_DIR, e) from None
    if progress:
      self._bar = tqdm.tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
    self._shown = start_step

  def write(self, step: int, scalars: dict[str, float]) -> None:
    """Logs `scalars` (numbers, numpy or 0-d jax arrays) at `step`; the JSON line is flushed at once.

    NaN/Inf are written as JSON's NaN/Infinity extensions, which `read_jsonl` reads back.
    """
    if not self.is_main:
      return
    values = {k: _number(k, v) for k, v in scalars.items()}
    try:
      self._jsonl.write(json.dumps({"step": int(step), **values}) + "\n")
      self._jsonl.flush()
    except OSError as e:
      raise write_error(self._jsonl.name, e) from None
    if self._tb is not None:
      self._check_tensorboard()
      for k, v in values.items():
        self._tb.add_scalar(k, v, step)
    if self._bar is not None:
      self._bar.update(max(0, step - self._shown))
      self._shown = max(self._shown, step)
      shown = {label: fmt.format(values[k]) for k, label, fmt in _PROGRESS if k in values}
      if shown:
        self._bar.set_postfix(shown, refresh=True)

  def write_text(self, step: int, tag: str, text: str) -> None:
    """Logs a text (e.g. a sampled completion) to TensorBoard."""
    if self._tb is not None:
      self._check_tensorboard()
      self._tb.add_text(tag, text, step)

  def _check_tensorboard(self) -> None:
    """Raises PathError once tensorboardX's writer thread has stopped (a failed write, e.g. a full disk):
    its queue would take a few more events and then block the run for ever."""
    event_writer = getattr(getattr(self._tb, "file_writer", None), "event_writer", None)
    worker = getattr(event_writer, "_worker", None)
    if worker is not None and not worker.is_alive():
      tb_dir = self._tb.logdir
      self._tb = None
      raise PathError(f"'{tb_dir}' cannot be written: the TensorBoard writer stopped (a full disk?); "
                      "free some space and run the same command again")

  def close(self) -> None:
    if self._tb is not None:
      tb, self._tb = self._tb, None
      try:
        tb.close()
      except OSError as e:
        raise write_error(tb.logdir, e) from None
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _number(key: str, v) -> int | float:
  a = np.asarray(v)
  if a.size != 1:
    raise TypeError(f"metric '{key}' must be a scalar, got shape {a.shape}")
  x = a.reshape(()).item()
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    return float(x)
  return x


def truncate_jsonl(path: pathlib.Path, last_step: int) -> None:
  """Keeps lines with step <= last_step; drops a torn last line and lines that are not UTF-8 JSON objects.

  Atomic rewrite via os.replace.
  """
  if not path.exists():
    return
  kept, changed = [], False
  with open(path, "rb") as f:
    for raw in f:
      try:
        line = raw.decode("utf-8")
        row = json.loads(line) if line.endswith("\n") else None
      except (UnicodeDecodeError, json.JSONDecodeError):
        row = None
      if isinstance(row, dict) and isinstance(row.get("step", math.inf), (int, float)) and \
          row.get("step", math.inf) <= last_step:
        kept.append(line)
      else:
        changed = True
  if changed:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- readers


def read_jsonl(path) -> list[dict]:
  """The rows of a metrics.jsonl file (a torn last line is skipped)."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        if line.endswith("\n"):
          raise
  return rows


def read_tensorboard_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} from every event file in `tb_dir`, in write order, honouring purge_step."""
  out: dict[str, list[tuple[int, float]]] = {}
  for step, tag, value in _summary_values(tb_dir, out):
    if value.HasField("simple_value"):
      out.setdefault(tag, []).append((step, float(value.simple_value)))
    elif value.metadata.plugin_data.plugin_name == "scalars" and value.tensor.float_val:
      out.setdefault(tag, []).append((step, float(value.tensor.float_val[0])))
  return out


def read_tensorboard_histograms(tb_dir) -> dict[str, list[tuple[int, int]]]:
  """{tag: [(step, number of values), ...]} of the histograms in `tb_dir`."""
  out: dict[str, list[tuple[int, int]]] = {}
  for step, tag, value in _summary_values(tb_dir, out):
    if value.HasField("histo"):
      out.setdefault(tag, []).append((step, int(value.histo.num)))
  return out


def read_tensorboard_text(tb_dir) -> dict[str, list[tuple[int, str]]]:
  """{tag: [(step, text), ...]} of the texts written with `write_text`."""
  out: dict[str, list[tuple[int, str]]] = {}
  for step, tag, value in _summary_values(tb_dir, out):
    if value.metadata.plugin_data.plugin_name == "text" and value.tensor.string_val:
      out.setdefault(tag.removesuffix("/text_summary"), []).append((step, value.tensor.string_val[0].decode()))
  return out


def _summary_values(tb_dir, out: dict):
  """Yields (step, tag, summary value); a session restart at step s drops what `out` holds at steps >= s."""
  files = sorted(glob.glob(os.path.join(str(tb_dir), "events.out.tfevents.*")), key=_first_wall_time)
  for path in files:
    for event in _events(path):
      if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
        for tag in out:
          out[tag] = [sv for sv in out[tag] if sv[0] < event.step]
      if event.HasField("summary"):
        for value in event.summary.value:
          yield event.step, value.tag, value


def _first_wall_time(path: str) -> tuple[float, str]:
  for event in _events(path):
    return event.wall_time, path
  return math.inf, path


def _events(path: str):
  """TFRecord reader: [uint64 length][uint32 masked crc of length][data][uint32 masked crc of data]."""
  with open(path, "rb") as f:
    while True:
      header = f.read(12)
      if len(header) < 12:
        return
      (length,), (crc,) = struct.unpack("<Q", header[:8]), struct.unpack("<I", header[8:])
      if masked_crc32c(header[:8]) != crc:
        return  # a torn or corrupt record ends the readable part of the file
      data, footer = f.read(length), f.read(4)
      if len(data) < length or len(footer) < 4 or masked_crc32c(data) != struct.unpack("<I", footer)[0]:
        return
      event = event_pb2.Event()
      event.ParseFromString(data)
      yield event

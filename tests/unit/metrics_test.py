"""Tests of erpo_jax.metrics: metrics.jsonl, TensorBoard read-back, resume de-duplication, process 0 only."""

import json
import pathlib
import re

import numpy as np
import pytest

from erpo_jax import metrics


def _write_steps(run_dir, steps, *, start_step=0, scale=1.0, **kw):
  with metrics.MetricsWriter(run_dir, total_steps=20, start_step=start_step, progress=False, **kw) as w:
    for s in steps:
      w.write(s, {"reward/mean": scale * s, "kl/query": np.float32(0.25 * s), "response/len_max": np.int32(s)})


def test_jsonl_has_one_line_per_write_with_the_step_and_values(tmp_path):
  _write_steps(tmp_path, [1, 2, 3])
  rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  # 0.25 * 3 = 0.75 is exact in float32.
  assert rows == [{"step": s, "reward/mean": float(s), "kl/query": 0.25 * s, "response/len_max": s} for s in (1, 2, 3)]
  assert isinstance(rows[0]["response/len_max"], int)


def test_tensorboard_scalars_read_back_equal_what_was_written(tmp_path):
  _write_steps(tmp_path, [1, 2, 3])
  tb = metrics.read_tensorboard_scalars(tmp_path / "tb")
  assert tb["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
  assert tb["kl/query"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
  assert tb["response/len_max"] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_text_reads_back_at_its_step(tmp_path):
  with metrics.MetricsWriter(tmp_path, total_steps=5, progress=False) as w:
    w.write_text(4, "samples/0", "What is 7+5? 7 + 5 = 12.")
  assert metrics.read_tensorboard_text(tmp_path / "tb") == {"samples/0": [(4, "What is 7+5? 7 + 5 = 12.")]}


def test_resume_drops_metrics_written_after_the_checkpoint(tmp_path):
  # A run logged steps 1..5, checkpointed at 3 and crashed; the resumed run rewrites 4..6.
  _write_steps(tmp_path, [1, 2, 3, 4, 5])
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "reward/me')  # torn line from the crash
  _write_steps(tmp_path, [4, 5, 6], start_step=3, scale=10.0)
  rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r["reward/mean"] for r in rows] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]
  assert not list(tmp_path.glob("*.tmp"))
  # TensorBoard: the resumed writer purges steps > 3 of the first run.
  tb = metrics.read_tensorboard_scalars(tmp_path / "tb")
  assert tb["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_resume_drops_lines_that_are_not_utf8_json_objects(tmp_path):
  _write_steps(tmp_path, [1, 2])
  with open(tmp_path / "metrics.jsonl", "ab") as f:
    f.write(b'{"step": 3, "note": "caf\xe9 \xff"}\n[1, 2]\n{"step": "x"}\n')
  _write_steps(tmp_path, [3], start_step=2, scale=10.0)
  rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_fresh_start_replaces_old_metrics(tmp_path):
  _write_steps(tmp_path, [1, 2])
  _write_steps(tmp_path, [1], scale=7.0)
  assert metrics.read_jsonl(tmp_path / "metrics.jsonl") == [
      {"step": 1, "reward/mean": 7.0, "kl/query": 0.25, "response/len_max": 1}]
  assert metrics.read_tensorboard_scalars(tmp_path / "tb")["reward/mean"] == [(1, 7.0)]


def test_non_finite_values_round_trip_through_jsonl(tmp_path):
  with metrics.MetricsWriter(tmp_path, total_steps=3, progress=False, tensorboard=False) as w:
    w.write(1, {"loss/total": float("nan"), "optim/grad_norm": np.float32("inf")})
  (row,) = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert np.isnan(row["loss/total"]) and row["optim/grad_norm"] == float("inf")


def test_each_jsonl_line_is_flushed_before_close(tmp_path):
  w = metrics.MetricsWriter(tmp_path, total_steps=3, progress=False)
  w.write(1, {"reward/mean": 0.5})
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.5}
  w.close()


def test_non_main_process_writes_nothing(tmp_path):
  run = tmp_path / "run"
  with metrics.MetricsWriter(run, total_steps=3, is_main=False) as w:
    w.write(1, {"reward/mean": 1.0})
    w.write_text(1, "samples/0", "x")
  assert not run.exists()


def test_tensorboard_off_writes_only_jsonl(tmp_path):
  _write_steps(tmp_path, [1], tensorboard=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_progress_bar_shows_step_reward_query_kl_and_tokens_per_second(tmp_path, capsys):
  with metrics.MetricsWriter(tmp_path, total_steps=10, start_step=2, tensorboard=False) as w:
    w.write(3, {"reward/mean": 0.625, "kl/query": 0.0015, "perf/tokens_per_s": 1234.4})
  err = capsys.readouterr().err
  assert "3/10" in err
  assert re.search(r"reward=0\.625, qkl=1\.50e-03, tok/s=1234", err)


def test_non_scalar_value_is_refused(tmp_path):
  with metrics.MetricsWriter(tmp_path, total_steps=3, progress=False, tensorboard=False) as w:
    with pytest.raises(TypeError, match="'reward/mean' must be a scalar"):
      w.write(1, {"reward/mean": np.zeros(2)})


def test_spec_scalars_cover_every_metric_the_spec_lists():
  names = set(metrics.SPEC_SCALARS)
  assert len(names) == len(metrics.SPEC_SCALARS)
  for required in ("kl/query", "kl/policy", "reward/mean", "reward/std", "reward/accuracy",
                   "reward/zero_std_groups", "entropy/mean", "loss/pg", "loss/kl", "loss/total", "clip/low",
                   "clip/high", "clip/dual", "ratio/mean", "ratio/min", "ratio/max", "weight/mean", "weight/min",
                   "weight/max", "prompt_nll/mean", "prompt_nll/min", "prompt_nll/max", "response/len_mean",
                   "response/len_max", "response/truncated", "optim/grad_norm", "optim/lr", "perf/tokens_per_s",
                   "time/rollout", "time/reward", "time/reference", "time/checkpoint_wait", "time/update",
                   "eval/gap",
                   "reward/overlong_penalty", "loss/masked_truncated"):
    assert required in names
  assert all(re.fullmatch(r"[a-z_]+/[a-z_]+", n) for n in names)


def test_reader_stops_at_a_torn_event_record(tmp_path):
  _write_steps(tmp_path, [1, 2])
  (event_file,) = pathlib.Path(tmp_path / "tb").glob("events.out.tfevents.*")
  data = event_file.read_bytes()
  event_file.write_bytes(data[:-5])  # the last record loses its tail, as in a crash mid-write
  tb = metrics.read_tensorboard_scalars(tmp_path / "tb")
  assert tb["reward/mean"] == [(1, 1.0), (2, 2.0)]
  assert tb["response/len_max"] == [(1, 1.0)]


def test_a_stopped_tensorboard_writer_is_a_path_error_not_a_hang(tmp_path, monkeypatch):
  import errno
  import threading
  from erpo_jax.errors import PathError
  from tensorboardX import event_file_writer

  real_write_event = event_file_writer.EventsWriter.write_event

  def full_disk(self, event):
    # The writer's own start-up events (the purge marker) go through the same thread, some time after the
    # constructor returns: only the scalars fail, so the thread stops at step 1 and nowhere else.
    if not event.HasField("summary"):
      return real_write_event(self, event)
    raise OSError(errno.ENOSPC, "No space left on device")

  w = metrics.MetricsWriter(tmp_path, total_steps=5, progress=False)
  monkeypatch.setattr(event_file_writer.EventsWriter, "write_event", full_disk)
  monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the writer thread's own report
  w.write(1, {"reward/mean": 1.0})
  worker = w._tb.file_writer.event_writer._worker  # pylint: disable=protected-access
  worker.join(timeout=30)
  assert not worker.is_alive()
  with pytest.raises(PathError, match=r"tb' cannot be written: the TensorBoard writer stopped"):
    for step in range(2, 40):  # more events than the writer's queue holds
      w.write(step, {"reward/mean": float(step)})
  w.close()
  assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]

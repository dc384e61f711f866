"""The training source is read once per process while its file and the options that read it stay the same."""

import json
import os

import pytest

from erpo_jax.config import Config, DataSection
from erpo_jax.data import sources
from erpo_jax.data.sources import train_source
from erpo_jax.errors import DataError


def _row(question: str, answer: str) -> bytes:
  return json.dumps({"question": question, "answer": f"#### {answer}"}).encode() + b"\n"


def _cfg(**data) -> Config:
  return Config(data=DataSection(**data))


@pytest.fixture(autouse=True)
def counted_reads(monkeypatch):
  """Empties the process's kept source and counts the reads of a data file."""
  monkeypatch.setattr(sources, "_TRAIN_SOURCE", {})
  reads = []
  load_file = sources.load_file
  monkeypatch.setattr(sources, "load_file", lambda *a, **k: reads.append(a[0]) or load_file(*a, **k))
  return reads


def test_a_data_file_is_read_once_and_every_reader_gets_the_same_records(tmp_path, counted_reads):
  path = tmp_path / "d.jsonl"
  path.write_bytes(_row("What is 1+1?", "2") + _row("What is 2+3?", "5"))
  cfg = _cfg(source=str(path))
  first, second = train_source(cfg), train_source(cfg)
  assert second is first
  assert [r.answer for r in first] == ["2", "5"]
  assert counted_reads == [str(path)]


def test_a_file_rewritten_in_place_with_the_same_size_and_time_is_read_again(tmp_path, counted_reads):
  path = tmp_path / "d.jsonl"
  path.write_bytes(_row("What is 1+1?", "2"))
  before = os.stat(path)
  assert [r.answer for r in train_source(_cfg(source=str(path)))] == ["2"]
  path.write_bytes(_row("What is 1+2?", "3"))  # the same inode and size
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
  assert os.stat(path).st_size == before.st_size and os.stat(path).st_ino == before.st_ino
  assert [r.answer for r in train_source(_cfg(source=str(path)))] == ["3"]
  assert len(counted_reads) == 2


def test_an_option_that_reads_the_source_differently_reads_it_again(tmp_path, counted_reads):
  path = tmp_path / "d.jsonl"
  path.write_bytes(_row("What is 1+1?", "2") + b'{"question": "What is 2+2?"}\n')
  with pytest.raises(DataError, match="d.jsonl:2"):
    train_source(_cfg(source=str(path)))
  skipping = train_source(_cfg(source=str(path), on_bad_row="skip"))
  assert len(skipping) == 1 and skipping.skipped == 1
  with pytest.raises(DataError, match="d.jsonl:2"):  # a failed read is never kept
    train_source(_cfg(source=str(path)))
  assert len(counted_reads) == 3


def test_options_that_do_not_read_the_source_share_it_and_builtin_sizes_do_not():
  a = train_source(_cfg(size=30, batch_size=2, max_prompt_tokens=64))
  assert train_source(_cfg(size=30, batch_size=8, max_prompt_tokens=0)) is a  # batching and lengths come later
  b = train_source(_cfg(size=31))
  assert len(a) == 30 and len(b) == 31

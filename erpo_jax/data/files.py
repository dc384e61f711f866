"""Problem files: JSONL and parquet rows in common shapes read into a RecordSource.

A source is a list-like of `Record`s (len, [i]). A malformed row raises DataError
naming `file:line` (JSONL) or `file:row i` (parquet, 0-based) and the field; with
on_bad_row="skip" it is skipped and counted in `source.skipped`, and the first
messages are kept in `source.bad_rows`.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
from typing import Iterator

from erpo_jax.data.records import BUILTIN_ARITHMETIC, Record
from erpo_jax.data.shapes import (
  CHAT_ROLES,
  SHAPES,
  RowError,
  check_untrusted,
  detect_shape,
  parse_row,
)
from erpo_jax.errors import ConfigError, DataError, PathError

_KEEP_BAD_ROWS = 10  # messages kept in source.bad_rows


class RecordSource:
  """A list of Records held in memory, with the count of skipped malformed rows."""

  def __init__(self, name: str, records: list[Record], skipped: int = 0, bad_rows: tuple[str, ...] = (),
               skip_reasons: dict[str, int] | None = None, shape: str = ""):
    self.name = name
    self.shape = shape  # the row shape of a file (data.shapes.SHAPES), "" for builtin sources
    self.records = records
    self.skipped = skipped  # malformed rows skipped (on_bad_row=skip)
    self.bad_rows = bad_rows  # the first few of their messages
    self.skip_reasons = dict(skip_reasons or {})  # reason -> number of rows skipped for it

  def __len__(self) -> int:
    return len(self.records)

  def __getitem__(self, i: int) -> Record:
    return self.records[i]

  def __iter__(self) -> Iterator[Record]:
    return iter(self.records)

  def __repr__(self) -> str:
    return f"RecordSource({self.name!r}, {len(self)} records, {self.skipped} skipped)"


def jsonl_rows(path: pathlib.Path) -> Iterator[tuple[str, dict | None, str]]:
  """(where, row or None, error message) per non-blank line."""
  try:
    data = path.read_bytes()
  except OSError as e:
    raise PathError(f"data file '{path}' cannot be read ({e.strerror or e})") from None
  for lineno, raw in enumerate(data.split(b"\n"), start=1):
    where = f"{path}:{lineno}"
    if not raw.strip():
      continue
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      yield where, None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
      continue
    try:
      row = json.loads(text)
    except json.JSONDecodeError as e:
      yield where, None, f"invalid JSON ({e.msg} at column {e.colno})"
      continue
    if not isinstance(row, dict):
      yield where, None, f"expected a JSON object, got {type(row).__name__}"
      continue
    yield where, row, ""


def parquet_rows(path: pathlib.Path) -> Iterator[tuple[str, dict | None, str]]:
  import pyarrow.parquet as pq  # slow to import; only parquet files need it
  try:
    pf = pq.ParquetFile(path)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"{path}: not a readable parquet file ({e})") from None
  i = 0
  for batch in pf.iter_batches(batch_size=4096):
    for row in batch.to_pylist():
      yield f"{path}:row {i}", row, ""
      i += 1


def _parquet_columns(path: pathlib.Path) -> list[str]:
  import pyarrow.parquet as pq  # slow to import; only parquet files need it
  try:
    return list(pq.read_schema(path).names)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f"{path}: not a readable parquet file ({e})") from None


def load_file(path: str | pathlib.Path, *, format: str = "auto", prompt_column: str = "",  # pylint: disable=redefined-builtin
              answer_column: str = "", on_bad_row: str = "error", roles=CHAT_ROLES) -> RecordSource:
  """Records of a .jsonl / .parquet file in one of the shapes of `erpo_jax.data.shapes`.

  format="auto" detects the shape from the columns (the parquet schema, or the first
  JSON object); prompt_column / answer_column override a shape's columns (an
  overridden answer column is taken as it is).
  """
  p = pathlib.Path(path)
  if not p.is_file():
    raise PathError(f"data file '{p}' not found: provide a .jsonl or .parquet file of problems "
                    f"(data.source / eval.sets), or use {BUILTIN_ARITHMETIC}")
  if format not in ("auto",) + SHAPES:
    raise ConfigError(f"data.format: expected one of auto, {', '.join(SHAPES)}, got {format!r}")
  if format == "columns" and not (prompt_column and answer_column):
    raise ConfigError("data.prompt_column, data.answer_column: expected column names with data.format=columns, "
                      f"got {prompt_column!r}, {answer_column!r}")
  suffix = "".join(p.suffixes[-1:]).lower()
  if suffix in (".jsonl", ".json"):
    rows, columns = jsonl_rows(p), None
  elif suffix in (".parquet", ".pq"):
    rows, columns = parquet_rows(p), _parquet_columns(p)
  else:
    raise PathError(f"data file '{p}': expected a .jsonl or .parquet file")
  return read_rows(p, rows, columns, format, prompt_column, answer_column, on_bad_row, roles)


def read_rows(p: pathlib.Path, rows, columns, format: str, prompt_column: str,  # pylint: disable=redefined-builtin
              answer_column: str, on_bad_row: str, roles=CHAT_ROLES) -> RecordSource:
  """Records of (where, row, error) triples, malformed rows raised or skipped per on_bad_row."""
  shape = None if format == "auto" else format
  if shape is None and columns is not None:
    shape = _detect_or_fail(p, columns, prompt_column, answer_column)
  records: list[Record] = []
  seen: dict[str, str] = {}
  skipped, bad, reasons = 0, [], collections.Counter()
  for where, row, error in rows:
    if row is not None and shape is None:
      shape = _detect_or_fail(p, row.keys(), prompt_column, answer_column, where)
    if row is not None:
      try:
        prompt, answer, level = parse_row(row, shape, prompt_column, answer_column)
        check_untrusted(prompt, answer, roles)
        rid = _row_id(row, where, p)
        if rid in seen:
          raise RowError("id", f"duplicate id '{rid}' (first at {seen[rid]})")
      except RowError as e:
        error = str(e)
    if error:
      if on_bad_row != "skip":
        raise DataError(f"{where}: {error}")
      skipped += 1
      reasons[_reason(error)] += 1
      if len(bad) < _KEEP_BAD_ROWS:
        bad.append(f"{where}: {error}")
      continue
    seen[rid] = where
    records.append(Record(id=rid, prompt=prompt, answer=answer, source=str(p), level=level))
  if not records:
    raise DataError(f"{p}: no usable rows" + (f" ({skipped} malformed, first: {bad[0]})" if bad else ""))
  return RecordSource(str(p), records, skipped, tuple(bad), dict(reasons), shape=shape or "")


def _reason(error: str) -> str:
  """A row error without its row-specific details: "invalid JSON", "field 'answer': missing", ..."""
  reason = re.sub(r"\s*\(.*$", "", error)
  return re.sub(r"duplicate id '.*'", "duplicate id", reason)


def _detect_or_fail(p, columns, prompt_column, answer_column, where=None) -> str:
  shape = detect_shape(columns, prompt_column, answer_column)
  if shape is None:
    raise DataError(f"{where or p}: cannot tell the row shape from columns {sorted(columns)}; set data.format "
                    "(verl, trl, gsm8k, math) or data.format=columns with data.prompt_column and "
                    "data.answer_column")
  return shape


def _row_id(row: dict, where: str, p: pathlib.Path) -> str:
  for key in ("id", "unique_id"):
    v = row.get(key)
    if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
      return str(v)
  return f"{p.name}:{where.rsplit(':', 1)[1].replace('row ', 'row')}"

"""Problem sources by name: a JSONL or parquet file (read by `data.files`), a preset read from data.preset_dir, or
builtin:arithmetic; the training source, read once per process; the eval sets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from typing import Iterator

from erpo_jax.data.arithmetic import generate
from erpo_jax.data.files import RecordSource, jsonl_rows, load_file, parquet_rows, read_rows
from erpo_jax.data.records import BUILTIN_ARITHMETIC
from erpo_jax.errors import ConfigError, DataError, PathError


PRESET_PREFIX = "preset:"


@dataclasses.dataclass(frozen=True)
class Preset:
  """A published data set read from a local file under data.preset_dir; nothing is downloaded."""

  files: tuple[str, ...]  # candidate paths under data.preset_dir, the first that exists is read
  get: str  # what to download and from where, for the error when none exists
  levels: tuple[int, ...] = ()  # keep only rows of these levels (MATH's "Level 3" ...)
  prompt_column: str = ""  # with format=columns
  answer_column: str = ""


def _files(stem: str) -> tuple[str, ...]:
  return (f"{stem}.jsonl", f"{stem}.parquet")


# The paper's training set and its six evaluation sets (SPEC.md, "Paper setup"), in the shapes they are
# published in. The gold is the `answer` column where there is one, else the solution's last \boxed{}.
PRESETS = {
    "math_l3to5": Preset(_files("math_train") + ("MATH/train",), levels=(3, 4, 5), get=(
        "the MATH training set (7,500 problems; levels 3-5 are kept): the train split of EleutherAI/hendrycks_math "
        "or qwedsacf/competition_math on Hugging Face as JSONL/parquet (problem, level, type, solution), or the "
        "MATH/train/ folder of the original release (github.com/hendrycks/math)")),
    "math500": Preset(_files("math500"), get="MATH-500: test.jsonl of HuggingFaceH4/MATH-500 on Hugging Face"),
    "aime24": Preset(_files("aime24"), get="AIME 2024: the train split of HuggingFaceH4/aime_2024 on Hugging Face"),
    "aime25": Preset(_files("aime25"), get="AIME 2025: the test split of math-ai/aime25 on Hugging Face"),
    "amc": Preset(_files("amc"), get="AMC 2022-2023: the train split of AI-MO/aimo-validation-amc on Hugging Face"),
    "minerva": Preset(_files("minerva"), prompt_column="question", answer_column="answer",
                      get="Minerva Math: the test split of math-ai/minervamath on Hugging Face"),
    "olympiadbench": Preset(_files("olympiadbench"), prompt_column="question", answer_column="answer",
                            get="OlympiadBench: the test split of math-ai/olympiadbench on Hugging Face (or "
                                "OlympiadBench's own English math JSON rows with question and final_answer)"),
}


def _json_folder_rows(folder: pathlib.Path) -> Iterator[tuple[str, dict | None, str]]:
  """(where, row, error) of each *.json file below folder, in path order (MATH's release layout)."""
  for path in sorted(folder.rglob("*.json")):
    try:
      row = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      yield f"{path}:1", None, f"invalid JSON ({e})"
      continue
    if not isinstance(row, dict):
      yield f"{path}:1", None, "expected a JSON object"
      continue
    yield f"{path}:1", {"id": path.relative_to(folder).as_posix(), **row}, ""


def _final_answer_as_answer(rows):
  """OlympiadBench's final_answer list ["a", "b"] as answer "a, b" where a row has no answer."""
  for where, row, error in rows:
    if row is not None and "answer" not in row and isinstance(row.get("final_answer"), list):
      row = {**row, "answer": ", ".join(str(a) for a in row["final_answer"])}
    yield where, row, error


def load_preset(spec: str, data) -> RecordSource:
  """Records of a preset ("preset:math500") from its file under data.preset_dir."""
  name = spec[len(PRESET_PREFIX):]
  if name not in PRESETS:
    raise ConfigError(f"data.source / eval.sets: unknown preset '{spec}'; expected one of "
                      f"{', '.join(PRESET_PREFIX + n for n in PRESETS)}")
  preset = PRESETS[name]
  root = pathlib.Path(data.preset_dir)
  found = next((root / f for f in preset.files if (root / f).exists()), None)
  if found is None:
    raise PathError(f"{spec}: no {' or '.join(str(root / f) for f in preset.files)}: get {preset.get}, and put it "
                    f"there (data.preset_dir={data.preset_dir}); nothing is downloaded at run time")
  fmt = "columns" if preset.answer_column else "auto"
  if found.is_dir():
    source = read_rows(found, _json_folder_rows(found), None, "math", "", "", data.on_bad_row)
  elif fmt == "columns":
    suffix = found.suffix.lower()
    rows = jsonl_rows(found) if suffix in (".jsonl", ".json") else parquet_rows(found)
    source = read_rows(found, _final_answer_as_answer(rows), None, fmt, preset.prompt_column, preset.answer_column,
                       data.on_bad_row)
  else:
    source = load_file(found, on_bad_row=data.on_bad_row)
  records = source.records
  if preset.levels:
    records = [r for r in records if r.level in preset.levels]
    if not records:
      raise DataError(f"{found}: no row of level {', '.join(map(str, preset.levels))} (a `level` column such as "
                      "'Level 3' is expected)")
  return RecordSource(f"{spec} ({found})", records, source.skipped, source.bad_rows, source.skip_reasons)


def open_source(spec: str, data, *, size: int | None = None, seed: int | None = None,
                exclude: frozenset[str] = frozenset()) -> RecordSource:
  """The source named by `spec` ("builtin:arithmetic", "preset:NAME" or a file) with the options of DataSection `data`.

  For builtin:arithmetic, size/seed default to data.size/data.builtin_seed; `exclude`
  lists problem texts that must not be generated (the training split, for eval).
  """
  if spec == BUILTIN_ARITHMETIC:
    n = data.size if size is None else size
    s = data.builtin_seed if seed is None else seed
    return RecordSource(f"{BUILTIN_ARITHMETIC}(seed={s})", generate(n, data.levels, s, exclude=exclude))
  if spec.startswith(PRESET_PREFIX):
    return load_preset(spec, data)
  if spec.startswith("builtin:"):
    raise ConfigError(f"data.source: unknown builtin data set '{spec}'; expected {BUILTIN_ARITHMETIC} or a file")
  return load_file(spec, format=data.format, prompt_column=data.prompt_column, answer_column=data.answer_column,
                   on_bad_row=data.on_bad_row, roles=data.chat_roles)


def train_source(cfg) -> RecordSource:
  """The whole training source (all processes), in dataset order: index i is PromptBatch.index i.

  Read once per process while the source and its file stay the same: the CLI reads it before JAX is imported
  (a malformed row fails in a fraction of a second) and the run's later readers get the same RecordSource.
  """
  key = _source_key(cfg.data)
  if key is not None and key in _TRAIN_SOURCE:
    return _TRAIN_SOURCE[key]
  source = open_source(cfg.data.source, cfg.data)
  if key is not None:
    _TRAIN_SOURCE.clear()  # one source kept: a process trains on one data set at a time
    _TRAIN_SOURCE[key] = source
  return source


_TRAIN_SOURCE: dict[tuple, RecordSource] = {}


def _source_key(data) -> tuple | None:
  """What a training source's records depend on: the options that read it and, for a file, a digest of its bytes
  (a file rewritten in place within the clock's tick keeps its size and time). None (read every time) for
  presets, which read several files."""
  options = (data.source, data.format, data.prompt_column, data.answer_column, data.on_bad_row,
             tuple(data.chat_roles))
  if data.source == BUILTIN_ARITHMETIC:
    return (*options, data.size, tuple(data.levels), data.builtin_seed)
  if data.source.startswith("builtin:") or data.source.startswith(PRESET_PREFIX):
    return None
  digest = hashlib.blake2b(digest_size=16)
  try:
    with open(data.source, "rb") as f:
      while block := f.read(1 << 20):
        digest.update(block)
  except OSError:
    return None  # open_source names the missing or unreadable file
  return (*options, digest.hexdigest())


def make_eval_source(cfg, set_name: str) -> RecordSource:
  """Records of one eval.sets entry, at most eval.max_problems (0 = all).

  "builtin:arithmetic" is the held-out split (eval.builtin_seed, eval.builtin_size, the
  levels of data.levels) with every training problem text excluded. A file's shape is
  detected from its columns (with data.format=columns, data's column names are used).
  """
  if set_name.startswith(PRESET_PREFIX):
    source = open_source(set_name, cfg.data)
  elif set_name == BUILTIN_ARITHMETIC:
    exclude: frozenset[str] = frozenset()
    if cfg.data.source == BUILTIN_ARITHMETIC:
      exclude = frozenset(r.prompt for r in generate(cfg.data.size, cfg.data.levels, cfg.data.builtin_seed))
    records = generate(cfg.eval.builtin_size, cfg.data.levels, cfg.eval.builtin_seed, exclude=exclude)
    source = RecordSource(f"{BUILTIN_ARITHMETIC}(seed={cfg.eval.builtin_seed})", records)
  else:
    columns = cfg.data.format == "columns"
    source = load_file(set_name, format="columns" if columns else "auto",
                       prompt_column=cfg.data.prompt_column if columns else "",
                       answer_column=cfg.data.answer_column if columns else "", on_bad_row=cfg.data.on_bad_row)
  if cfg.eval.max_problems and len(source) > cfg.eval.max_problems:
    source = RecordSource(source.name, source.records[:cfg.eval.max_problems], source.skipped, source.bad_rows)
  return source

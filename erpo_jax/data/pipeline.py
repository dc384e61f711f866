"""Grain input pipeline: one global shuffled order, each process its slice of every global batch.

The source is shuffled with data.shuffle_seed + epoch (a new order every epoch,
the same for the same seed) and repeated forever: one global stream, whatever
the number of processes. Global batch t is the next B = data.batch_size prompts
of it, and process p of P takes its contiguous slice of B_local = B / P prompts,
global batch rows [p*B_local, (p+1)*B_local): the rows its devices hold under
the batch sharding, so P processes feed exactly the batches one process would.
Prompts are tokenized with the prompt template; those longer than
data.max_prompt_tokens are truncated from the left, skipped (and counted) or
reported, per data.on_overlong. The iterator state is a JSON-serialisable dict.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
from typing import Any

import grain
import numpy as np

from erpo_jax.data.check import resolve_max_prompt_tokens
from erpo_jax.data.prompts import (
  encode_prompt,
  fit_length,
  fit_mask,
  overlong_error,
  unlocated_question_error,
)
from erpo_jax.data.records import Record
from erpo_jax.data.files import RecordSource
from erpo_jax.data.sources import train_source
from erpo_jax.errors import ConfigError, DataError

log = logging.getLogger(__name__)

_STATE_VERSION = 2  # 2: one global order, each process a slice of every global batch (1: one shard per process)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """One host's prompts for one update batch (B_local = data.batch_size / process_count)."""

  ids: list[str]  # [B_local] record ids
  prompt_tokens: list[list[int]]  # [B_local][P_b] unpadded prompt ids (the sampler pads and buckets)
  answers: list[str]  # [B_local] ground truths
  texts: list[str]  # [B_local] rendered prompt texts (before any truncation)
  index: np.ndarray  # [B_local] int64 position of each prompt in the whole training source
  question_masks: list  # [B_local][P_b] bool: the question's tokens (None: not locatable, see prompts.py)


class _Indexed:
  """Grain random-access source: i -> (i, record), so the global index survives sharding and shuffling."""

  def __init__(self, source: RecordSource):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> tuple[int, Record]:
    return i, self._source[i]


class _RowsOfProcess(grain.MapDataset):
  """Process p's slice of every global batch of B from a global stream: i -> (i // b) * B + p * b + i % b."""

  def __init__(self, parent: grain.MapDataset, global_batch: int, local_batch: int, process_index: int):
    super().__init__(parent)
    self._B, self._b, self._offset = global_batch, local_batch, process_index * local_batch

  def __len__(self) -> int:
    return len(self._parent) // self._B * self._b

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    t, j = divmod(index, self._b)
    return self._parent[t * self._B + self._offset + j]


class _Encode:
  """Picklable map (it runs in Grain workers): (i, record) -> encoded prompt as a plain dict."""

  def __init__(self, tokenizer, data):
    self.tokenizer = tokenizer
    self.data = data

  def __call__(self, item: tuple[int, Record]) -> dict[str, Any]:
    i, record = item
    enc = encode_prompt(record, self.tokenizer, self.data, check=False)
    return {"index": i, "record": record, "tokens": enc.tokens, "text": enc.text, "overlong": enc.overlong,
            "question_mask": enc.question_mask}


def _ensure_absl_flags() -> None:
  """Grain's worker processes read absl flags; parse them (program name only) if nobody has."""
  from absl import (
    flags,  # absl comes with grain; imported only where its flags are needed
  )
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(sys.argv[:1] or ["erpo-jax"])


def _picklable(obj) -> bool:
  try:
    pickle.dumps(obj)
    return True
  except Exception:  # pylint: disable=broad-except
    return False


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # the Grain worker processes import this module: jax only when asked
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  return process_index, process_count


class TrainIterator:
  """Endless iterator of PromptBatch for one process; get_state/set_state resume it exactly."""

  def __init__(self, cfg, tokenizer, process_index: int, process_count: int, source: RecordSource):
    cfg = _resolved(cfg, tokenizer)
    data = cfg.data
    if data.batch_size % process_count:
      raise ConfigError(f"data.batch_size: expected a multiple of the number of processes ({process_count}), "
                        f"got {data.batch_size}")
    if not 0 <= data.shuffle_seed < 2**32:
      raise ConfigError(f"data.shuffle_seed: expected an integer in [0, 2**32), got {data.shuffle_seed}")
    self.data = data
    self.batch_per_host = data.batch_size // process_count  # B_local
    self.source = source
    # Prompts dropped by data.on_overlong=skip, counted over whole global batches (equal on every process).
    self.skipped_overlong = 0
    self._meta = {"version": _STATE_VERSION, "num_records": len(source), "shuffle_seed": data.shuffle_seed,
                  "process_index": process_index, "process_count": process_count, "num_workers": data.num_workers}
    # Shuffle before repeat: ShuffleMapDataset reseeds with seed + epoch for indices past one epoch.
    ds = grain.MapDataset.source(_Indexed(source)).shuffle(seed=data.shuffle_seed).repeat()
    if data.on_overlong == "skip" and process_count > 1:
      # Which prompts a global batch skips depends on all of its prompts: every process reads
      # (and tokenizes) whole global batches and keeps its slice of the prompts that remain.
      self._rows_read, self._keep = data.batch_size, slice(process_index * self.batch_per_host,
                                                          (process_index + 1) * self.batch_per_host)
    else:
      # Nothing is skipped: each process reads only its own B_local prompts of each global batch.
      ds = _RowsOfProcess(ds, data.batch_size, self.batch_per_host, process_index)
      self._rows_read, self._keep = self.batch_per_host, slice(None)
    self._encode = _Encode(tokenizer, data)
    self.tokenize_in_workers = data.num_workers == 0 or _picklable(tokenizer)
    if self.tokenize_in_workers:
      ds = ds.map(self._encode)
    else:
      log.warning("the tokenizer cannot be pickled for Grain's worker processes; prompts are tokenized in the "
                  "main process")
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=max(8, 2 * self._rows_read)))
    if data.num_workers > 0:
      _ensure_absl_flags()
      it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data.num_workers))
    self._it = iter(it_ds)

  def __iter__(self) -> TrainIterator:
    return self

  def __next__(self) -> PromptBatch:
    picked = []
    skipped_in_a_row = 0
    while len(picked) < self._rows_read:
      e = next(self._it)
      if not self.tokenize_in_workers:
        e = self._encode(e)
      if e["overlong"] and self.data.on_overlong == "error":
        raise overlong_error(e["record"], len(e["tokens"]), self.data.max_prompt_tokens)
      if e["overlong"] and self.data.on_overlong == "skip":
        self.skipped_overlong += 1
        skipped_in_a_row += 1
        if skipped_in_a_row > len(self.source):
          raise DataError(f"{self.source.name}: every prompt has more than data.max_prompt_tokens="
                          f"{self.data.max_prompt_tokens} tokens")
        continue
      skipped_in_a_row = 0
      picked.append(e)
    picked = picked[self._keep]
    return PromptBatch(ids=[e["record"].id for e in picked], prompt_tokens=[e["tokens"] for e in picked],
                       answers=[e["record"].answer for e in picked], texts=[e["text"] for e in picked],
                       index=np.array([e["index"] for e in picked], dtype=np.int64),
                       question_masks=[e["question_mask"] for e in picked])

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position: the Grain iterator state plus the overlong-skip count."""
    return {"meta": dict(self._meta), "grain": self._it.get_state(), "skipped_overlong": self.skipped_overlong}

  def set_state(self, state: dict[str, Any]) -> None:
    saved = state.get("meta", {})
    if saved.get("version") != _STATE_VERSION:
      raise DataError(f"data iterator state has format version {saved.get('version')!r}, this erpo-jax reads "
                      f"version {_STATE_VERSION}; start a fresh run.dir")
    for key, value in self._meta.items():
      if saved.get(key) != value:
        raise DataError(f"data iterator state was saved with {key}={saved.get(key)!r} but this run has "
                        f"{key}={value!r}; resume with the same data.source, data.shuffle_seed, data.num_workers "
                        "and number of processes")
    self._it.set_state(_int_keys(state["grain"]))
    self.skipped_overlong = int(state["skipped_overlong"])

  def close(self) -> None:
    close = getattr(self._it, "close", None)
    if close is not None:
      close()


def _int_keys(state: Any) -> Any:
  """Grain keeps some per-shard states in dicts keyed by int; JSON turned those keys into strings."""
  if isinstance(state, dict):
    return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v) for k, v in state.items()}
  if isinstance(state, list):
    return [_int_keys(v) for v in state]
  return state


def _resolved(cfg, tokenizer):
  """cfg with data.max_prompt_tokens = 0 (auto) resolved (erpo_jax.data.check); the commands resolve it first."""
  if cfg.data.max_prompt_tokens:
    return cfg
  return resolve_max_prompt_tokens(cfg, tokenizer)


def make_train_iterator(cfg, tokenizer, process_index: int | None = None,
                        process_count: int | None = None) -> TrainIterator:
  """The training iterator of this process (defaults: jax.process_index() / jax.process_count())."""
  process_index, process_count = _process(process_index, process_count)
  return TrainIterator(cfg, tokenizer, process_index, process_count, train_source(cfg))


def training_prompts(cfg, tokenizer) -> list[tuple[str, list[int] | None]]:
  """(id, prompt token ids) of every training record in dataset order (position = PromptBatch.index).

  Tokens are those training feeds the model (truncated under on_overlong=truncate);
  None marks a prompt that training skips (on_overlong=skip); on_overlong=error raises.
  """
  cfg = _resolved(cfg, tokenizer)
  out = []
  for record in train_source(cfg):
    enc = encode_prompt(record, tokenizer, cfg.data)
    skip = enc.overlong and cfg.data.on_overlong == "skip"
    out.append((record.id, None if skip else enc.tokens))
  return out


def check_training_data(cfg, tokenizer) -> None:
  """Raises DataError for a malformed training row, or for an overlong prompt under data.on_overlong=error.

  Cheap enough to run before a model is loaded: it parses the source, and tokenizes
  every prompt only when on_overlong=error needs the lengths.
  """
  if cfg.data.on_overlong == "error":
    training_prompts(cfg, tokenizer)
  else:
    train_source(cfg)


def dataset_prompts(cfg, tokenizer) -> list[tuple[list[int], list[bool] | None]]:
  """(prompt ids, question mask) of every training record in dataset order, at most data.max_prompt_tokens.

  As `training_prompts`, except that a prompt training skips as overlong is given
  left-truncated (fit_length) instead of None, so every position has tokens.
  erpo.query_span=question needs every question located (DataError otherwise).
  """
  cfg = _resolved(cfg, tokenizer)
  out = []
  for record in train_source(cfg):
    enc = encode_prompt(record, tokenizer, cfg.data)
    mask = enc.question_mask
    if mask is None and cfg.erpo.query_span == "question":
      raise unlocated_question_error(record)
    if mask is not None and len(enc.tokens) > cfg.data.max_prompt_tokens:
      mask = fit_mask(enc.tokens, mask, cfg.data.max_prompt_tokens, tokenizer.bos_id)
    out.append((fit_length(enc.tokens, cfg.data.max_prompt_tokens, tokenizer.bos_id), mask))
  return out

"""`erpo-jax data check`: what a data set holds before a run, and the prompt length it needs.

Reads data.source as training would (malformed rows skipped and counted by reason,
whatever data.on_bad_row says), renders and tokenizes every prompt with the
model's tokenizer and the prompt template, verifies each gold against itself
through the reward path, and suggests data.max_prompt_tokens. The same
suggestion is what data.max_prompt_tokens = 0 (auto) resolves to.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from erpo_jax.data.prompts import prompt_text
from erpo_jax.data.files import load_file
from erpo_jax.data.sources import (
  PRESET_PREFIX,
  make_eval_source,
  open_source,
  train_source,
)
from erpo_jax.errors import ConfigError
from erpo_jax.model.io.sources import load_tokenizer
from erpo_jax.reward.verifier import Verifier

log = logging.getLogger(__name__)

AUTO_MULTIPLE = 64  # the automatic prompt limit is the longest prompt rounded up to a multiple of this
AUTO_CAP = 4096  # and at most this many tokens (longer prompts follow data.on_overlong)
QUANTILES = (0.5, 0.9, 0.95, 0.99)
_SHOWN_FAILURES = 5


@dataclasses.dataclass(frozen=True)
class DataReport:
  source: str
  rows_read: int  # rows in the file (usable + skipped)
  usable: int
  skipped: int
  skip_reasons: dict[str, int]  # reason -> rows
  bad_rows: tuple[str, ...]  # the first few skipped rows, with file:line
  lengths: np.ndarray  # [usable] prompt tokens of each record, as rendered
  quantiles: dict[float, int]  # q -> prompt tokens
  self_verified: int  # golds scored correct against themselves
  not_self_verified: tuple[tuple[str, str], ...]  # the first few (record id, gold) that are not
  gold_form: str  # how the gold was written as a response, e.g. "\\boxed{GOLD}"
  suggested_max_prompt_tokens: int
  current_max_prompt_tokens: int  # the config's value (0 = auto)

  @property
  def overlong_at_current(self) -> int:
    limit = self.current_max_prompt_tokens or self.suggested_max_prompt_tokens
    return int((self.lengths > limit).sum())


def suggest_max_prompt_tokens(lengths) -> int:
  """The longest prompt rounded up to a multiple of AUTO_MULTIPLE, at most AUTO_CAP."""
  longest = int(max(lengths, default=2))
  return max(2, min(AUTO_CAP, AUTO_MULTIPLE * math.ceil(longest / AUTO_MULTIPLE)))


def prompt_lengths(cfg, tokenizer, records) -> np.ndarray:
  """[N] token count of each record's prompt rendered with data's template (never truncated)."""
  return np.array([len(tokenizer.encode(prompt_text(r, tokenizer, cfg.data))) for r in records], dtype=np.int64)


def gold_response(gold: str, extract: str) -> tuple[str, str]:
  """(response, form): the gold written as a response that reward.extract reads."""
  if extract == "gsm8k":
    return f"#### {gold}", "#### GOLD"
  if extract == "last_number":
    return gold, "GOLD"
  return f"\\boxed{{{gold}}}", "\\boxed{GOLD}"


def _source_for_check(cfg):
  """data.source with malformed rows skipped and counted, whatever data.on_bad_row says."""
  d = dataclasses.replace(cfg.data, on_bad_row="skip")
  if d.source.startswith(("builtin:", PRESET_PREFIX)):
    return open_source(d.source, d)
  return load_file(d.source, format=d.format, prompt_column=d.prompt_column, answer_column=d.answer_column,
                   on_bad_row="skip")


def check_data(cfg, tokenizer=None, *, verifier=None) -> DataReport:
  """The report of cfg.data.source; loads the model's tokenizer unless one is given."""
  if tokenizer is None:
    tokenizer = load_tokenizer(cfg.model)
  source = _source_for_check(cfg)
  records = list(source)
  lengths = prompt_lengths(cfg, tokenizer, records)
  quantiles = {q: int(np.ceil(np.quantile(lengths, q))) for q in QUANTILES}
  responses, form = [], ""
  for r in records:
    response, form = gold_response(r.answer, cfg.reward.extract)
    responses.append(response)
  own = verifier is None
  verifier = verifier or Verifier(cfg.reward)
  try:
    scored = verifier.score(responses, [r.answer for r in records])
  finally:
    if own:
      verifier.close()
  failing = tuple((r.id, r.answer) for r, ok in zip(records, scored.correct) if not ok)
  return DataReport(source=source.name, rows_read=len(records) + source.skipped, usable=len(records),
                    skipped=source.skipped, skip_reasons=dict(getattr(source, "skip_reasons", {})),
                    bad_rows=tuple(source.bad_rows), lengths=lengths, quantiles=quantiles,
                    self_verified=int(scored.correct.sum()), not_self_verified=failing[:_SHOWN_FAILURES],
                    gold_form=form, suggested_max_prompt_tokens=suggest_max_prompt_tokens(lengths),
                    current_max_prompt_tokens=cfg.data.max_prompt_tokens)


def format_report(rep: DataReport, cfg) -> str:
  """The report as the lines `erpo-jax data check` prints."""
  d = cfg.data
  lines = [f"data check: {rep.source}",
           f"rows: {rep.rows_read} read, {rep.usable} usable, {rep.skipped} skipped"]
  for reason, n in sorted(rep.skip_reasons.items(), key=lambda kv: -kv[1]):
    lines.append(f"  skipped {n}: {reason}")
  for row in rep.bad_rows[:3]:
    lines.append(f"    e.g. {row}")
  template = (f"chat template {'on' if d.chat_template else 'off'}, "
              f"system prompt {'set' if d.system_prompt else 'none'}, suffix {len(d.prompt_suffix)} chars")
  q = ", ".join(f"p{int(k * 100)} {v}" for k, v in rep.quantiles.items())
  lines.append(f"prompt tokens ({template}): min {int(rep.lengths.min())}, {q}, max {int(rep.lengths.max())}")
  lines.append(f"golds that verify against themselves (reward.extract={cfg.reward.extract}, written as "
               f"{rep.gold_form}): {rep.self_verified}/{rep.usable}")
  for rid, gold in rep.not_self_verified:
    lines.append(f"  does not verify: record '{rid}': {gold[:120]!r}")
  current = d.max_prompt_tokens
  now = "0 (auto)" if current == 0 else str(current)
  lines.append(f"suggested data.max_prompt_tokens: {rep.suggested_max_prompt_tokens} (the longest prompt, "
               f"{int(rep.lengths.max())} tokens, rounded up to a multiple of {AUTO_MULTIPLE}, at most {AUTO_CAP}); "
               f"config: {now}, {rep.overlong_at_current} prompt(s) longer (data.on_overlong={d.on_overlong})")
  return "\n".join(lines)


def run_check(cfg) -> DataReport:
  """erpo-jax data check: prints the report of cfg.data.source."""
  cfg = resolve_extract(cfg)
  rep = check_data(cfg)
  print(format_report(rep, cfg))
  return rep


def extraction_for_data(cfg) -> str:
  """reward.extract=data resolved: "boxed" (the paper's strict setting) for MATH-style training data,
  a MATH-shaped file or a preset, else "auto" (the lenient fallback)."""
  spec = cfg.data.source
  if spec.startswith(PRESET_PREFIX):
    return "boxed"
  if spec.startswith("builtin:"):
    return "auto"
  return "boxed" if _source_for_check(cfg).shape == "math" else "auto"  # malformed rows do not decide it


def resolve_extract(cfg):
  """cfg with reward.extract=data replaced by the mode its training data calls for; unchanged otherwise.

  Applied where the verifier is made (the run's saved config keeps `data`, so a resume or a rerun of an
  experiment compares like with like)."""
  if cfg.reward.extract != "data":
    return cfg
  mode = extraction_for_data(cfg)
  log.info("reward.extract=data -> %s (training data %s)", mode, cfg.data.source)
  return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, extract=mode))


def resolve_max_prompt_tokens(cfg, tokenizer=None):
  """cfg with data.max_prompt_tokens = 0 (auto) replaced by the suggestion for the training data
  and the eval sets' files; cfg unchanged when it is set."""
  if cfg.data.max_prompt_tokens != 0:
    return cfg
  if tokenizer is None:
    tokenizer = load_tokenizer(cfg.model)
  records = list(train_source(cfg))
  for name in cfg.eval.sets:
    records += list(make_eval_source(cfg, name))
  lengths = prompt_lengths(cfg, tokenizer, records)
  value = suggest_max_prompt_tokens(lengths)
  if value < int(lengths.max()):
    log.warning("data.max_prompt_tokens=0 (auto): %d prompt(s) are longer than the cap of %d tokens and follow "
                "data.on_overlong=%s", int((lengths > value).sum()), AUTO_CAP, cfg.data.on_overlong)
  log.info("data.max_prompt_tokens=0 (auto) -> %d (longest prompt %d tokens)", value, int(lengths.max()))
  if value < 2:
    raise ConfigError(f"data.max_prompt_tokens: auto gave {value}; set it explicitly")
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=value))

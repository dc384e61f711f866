"""Config sections of how a run executes: steps, mesh, checkpoints, logging, evaluation, folders, experiment grid.

What is trained and how (model, data, rewards, rollout, ERPO, PPO, optimizer) is in
config.py, which composes both into `Config`. `check_field` is the one validation
helper of every section.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from erpo_jax.errors import ConfigError


FLOAT32_MAX = 3.4028234663852886e38  # optimizer hyperparameters above it are Inf in a float32 update


def check_field(cond: bool, key: str, expected: str, value: Any) -> None:
  """Raises ConfigError `key: expected <expected>, got <value>` unless cond."""
  if not cond:
    raise ConfigError(f"{key}: expected {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = 30  # update batches
  seed: int = 0  # sampling PRNG seed
  skip_nonfinite: bool = False  # skip an update with NaN/Inf instead of stopping
  eval_every: int = 0  # 0 = no eval during training
  log_every: int = 1

  def __post_init__(self):
    check_field(self.steps >= 1, "train.steps", "an integer >= 1", self.steps)
    check_field(self.eval_every >= 0, "train.eval_every", "an integer >= 0", self.eval_every)
    check_field(self.log_every >= 1, "train.log_every", "an integer >= 1", self.log_every)


@dataclasses.dataclass(frozen=True)
class MeshSection:
  # Device counts per named mesh axis; -1 = all remaining devices.
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = (self.data, self.fsdp, self.tensor)
    check_field(all(s == -1 or s >= 1 for s in sizes), "mesh", "sizes >= 1 or -1", sizes)
    check_field(sum(s == -1 for s in sizes) <= 1, "mesh", "at most one axis of size -1", sizes)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = 10  # steps between checkpoints (0 = only at the end and on SIGTERM)
  keep: int = 3  # most recent checkpoints kept
  async_save: bool = True

  def __post_init__(self):
    check_field(self.every >= 0, "checkpoint.every", "an integer >= 0", self.every)
    check_field(self.keep >= 1, "checkpoint.keep", "an integer >= 1", self.keep)


@dataclasses.dataclass(frozen=True)
class LogSection:
  tensorboard: bool = True  # <run.dir>/tb
  samples_every: int = 10  # steps between sample completions logged as text (0 = never)
  num_samples: int = 2
  progress: bool = True  # console progress bar
  # With erpo.reference=cached the step has no reference forward, so Policy-KL (response k3) comes
  # every this many steps from a variant of the step with one reference forward of the batch (0 = never:
  # no reference kept); erpo.reference=forward logs it every step for free.
  policy_kl_every: int = 5
  # <run.dir>/data_indices.process<p>.jsonl: per step, the dataset indices of the prompts process p fed
  # (one {"step", "index"} line per step); audits the data order and the split across processes.
  data_indices: bool = False

  def __post_init__(self):
    check_field(self.policy_kl_every >= 0, "log.policy_kl_every", "an integer >= 0", self.policy_kl_every)


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
    check_field(self.k >= 1, "eval.k", "an integer >= 1", self.k)
    check_field(self.batch_size >= 1, "eval.batch_size", "an integer >= 1", self.batch_size)
    check_field(self.max_problems >= 0, "eval.max_problems", "an integer >= 0 (0 = all)", self.max_problems)
    check_field(self.max_new_tokens >= 0, "eval.max_new_tokens", "an integer >= 0 (0 = rollout.max_new_tokens)",
           self.max_new_tokens)
    check_field(self.builtin_size >= 1, "eval.builtin_size", "an integer >= 1", self.builtin_size)
    check_field(all(t >= 0 for t in self.temperatures), "eval.temperatures", "numbers >= 0", self.temperatures)


@dataclasses.dataclass(frozen=True)
class RunSection:
  dir: str = "runs/default"  # checkpoints, tb/, metrics.jsonl, config.yaml

  def __post_init__(self):
    check_field(bool(self.dir.strip()), "run.dir", "a folder (the working directory is never a run folder)", self.dir)


# The ablation variants of `erpo-jax experiment` (their overrides: erpo_jax/experiment/grid.py VARIANTS).
VariantName = Literal["grpo", "grpo_star", "query_kl", "erpo_static", "erpo_dynamic", "rloo", "rloo_erpo", "dapo",
                      "dapo_erpo"]


@dataclasses.dataclass(frozen=True)
class ExperimentSection:
  """`erpo-jax experiment`: variants x seeds as run folders <dir>/runs/<variant>-s<seed>, then eval and report."""

  variants: tuple[VariantName, ...] = ("grpo", "erpo_static", "erpo_dynamic")
  seeds: tuple[int, ...] = (0, 1)  # each sets train.seed and data.shuffle_seed of its runs
  dir: str = "runs/experiment"  # experiment folder: runs/, plots/, report.md
  base_eval: bool = True  # also evaluate the untrained model (the reference line of the plots)
  final_window: int = 5  # "final" train metrics: mean over the rows of the last this many steps
  smooth: int = 1  # step plots: trailing moving average over this many steps (1 = raw)
  analyze_num: int = 32  # training questions of the NLL analysis per model (0 = no analysis)
  analyze_seed: int = 0  # which questions, and the sampling key of their responses

  def __post_init__(self):
    check_field(len(self.variants) > 0 and len(set(self.variants)) == len(self.variants), "experiment.variants",
           "a non-empty list of distinct variant names", self.variants)
    check_field(len(self.seeds) > 0 and len(set(self.seeds)) == len(self.seeds), "experiment.seeds",
           "a non-empty list of distinct integers", self.seeds)
    check_field(bool(self.dir), "experiment.dir", "a folder path", self.dir)
    check_field(self.final_window >= 1, "experiment.final_window", "an integer >= 1", self.final_window)
    check_field(self.smooth >= 1, "experiment.smooth", "an integer >= 1", self.smooth)
    check_field(self.analyze_num >= 0, "experiment.analyze_num", "an integer >= 0", self.analyze_num)

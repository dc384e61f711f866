"""Config sections of the update: PPO's clipping, loss aggregation, advantages and batching, and the optimizer.

config.py composes them into `Config` with the other sections.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from erpo_jax.config_run import FLOAT32_MAX, check_field


@dataclasses.dataclass(frozen=True)
class PpoSection:
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float | None = None  # c > 1, or null for off
  loss_aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
  # Advantage estimator (SPEC section 3): grpo = group mean/std; rloo = r_i minus the mean of the group's
  # other rows; reinforce = r_i minus the group mean (= grpo with advantage_scale=none).
  advantage: Literal["grpo", "rloo", "reinforce"] = "grpo"
  # grpo only: the std that divides r_i - mean_g; none = Dr.GRPO.
  advantage_scale: Literal["group", "batch", "none"] = "group"
  advantage_eps: float = 1e-6  # grpo only: added to the std
  # Optimizer steps per update batch: each minibatch (B / minibatches whole prompt groups) is one step,
  # its loss normalised over its own tokens / rows (verl's convention).
  minibatches: int = 1
  # Gradient accumulation inside one optimizer step: a memory knob, the same update (exact minibatch
  # denominators). Each microbatch holds B / (minibatches * microbatches) whole prompt groups.
  microbatches: int = 1
  epochs: int = 1  # passes over each update batch
  entropy_coef: float = 0.0
  # DAPO's overlong filtering: rows truncated at rollout.max_new_tokens (no EOS) are left out of the loss
  # (policy-gradient term, response KL and their token / row counts); their rewards still enter the advantages.
  mask_truncated: bool = False

  def __post_init__(self):
    check_field(0 <= self.eps_low < 1, "ppo.eps_low", "a number in [0, 1)", self.eps_low)
    check_field(self.eps_high >= 0, "ppo.eps_high", "a number >= 0", self.eps_high)
    check_field(self.dual_clip is None or self.dual_clip > 1, "ppo.dual_clip", "null or a number > 1", self.dual_clip)
    check_field(self.minibatches >= 1, "ppo.minibatches", "an integer >= 1", self.minibatches)
    check_field(self.microbatches >= 1, "ppo.microbatches", "an integer >= 1", self.microbatches)
    check_field(self.epochs >= 1, "ppo.epochs", "an integer >= 1", self.epochs)
    check_field(self.advantage == "grpo" or self.advantage_scale == "group", "ppo.advantage_scale",
           f"'group' (the default) with ppo.advantage={self.advantage}: advantage_scale applies to "
           "ppo.advantage=grpo only", self.advantage_scale)
    # With eps = 0 a group whose rewards are all equal divides 0 by 0.
    check_field(0 < self.advantage_eps < math.inf or self.advantage_scale == "none" or self.advantage != "grpo",
           "ppo.advantage_eps", "a finite number > 0 (or ppo.advantage_scale=none)", self.advantage_eps)
    check_field(math.isfinite(self.entropy_coef), "ppo.entropy_coef", "a finite number", self.entropy_coef)


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
    check_field(self.lr > 0, "optim.lr", "a positive number", self.lr)
    check_field(self.lr <= FLOAT32_MAX, "optim.lr", "a finite number in float32 (at most 3.4e38)", self.lr)
    check_field(0 <= self.b1 < 1, "optim.b1", "a number in [0, 1)", self.b1)
    check_field(0 <= self.b2 < 1, "optim.b2", "a number in [0, 1)", self.b2)
    check_field(0 < self.eps <= FLOAT32_MAX, "optim.eps", "a positive number, finite in float32", self.eps)
    check_field(self.weight_decay >= 0, "optim.weight_decay", "a number >= 0", self.weight_decay)
    check_field(self.grad_clip >= 0, "optim.grad_clip", "a number >= 0", self.grad_clip)
    check_field(self.warmup_steps >= 0, "optim.warmup_steps", "an integer >= 0", self.warmup_steps)

"""Group-relative advantages: the per-row constants of the task term (SPEC section 3).

Dimension letters: B prompts (groups), G samples per prompt, N = B * G rows,
G_v the valid (non-padding) rows of a group. Three estimators, each a pure
function of the rewards and the group ids, without gradient:

- grpo:      A_i = (r_i - mean_g) / (std_g + eps)       (scale: group, batch or none)
- rloo:      A_i = r_i - mean of the other valid rows of g = G_v / (G_v - 1) * (r_i - mean_g)
- reinforce: A_i = r_i - mean_g                         (= grpo with scale none)

A group whose valid rewards are all equal gets A = 0 exactly under each of them (its mean is the common
reward, though a float sum of rewards such as 0.1 does not divide back to it exactly).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp


Scale = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo", "reinforce"]


class _Groups(NamedTuple):
  r_N: jax.Array  # rewards, 0 on padding rows
  valid_N: jax.Array  # bool
  count_B: jax.Array  # G_v per group
  sum_B: jax.Array  # sum of the group's valid rewards
  uniform_B: jax.Array  # bool: the group's valid rewards are all equal


def _groups(rewards_N, group_id_N, num_groups: int, valid_N) -> _Groups:
  r_N = jax.lax.stop_gradient(jnp.asarray(rewards_N, jnp.result_type(rewards_N, jnp.float32)))
  valid_N = jnp.ones(r_N.shape, bool) if valid_N is None else jnp.asarray(valid_N, bool)
  r_N = jnp.where(valid_N, r_N, 0.0)
  count_B = jax.ops.segment_sum(valid_N.astype(r_N.dtype), group_id_N, num_groups)
  high_B = jax.ops.segment_max(jnp.where(valid_N, r_N, -jnp.inf), group_id_N, num_groups)
  low_B = jax.ops.segment_min(jnp.where(valid_N, r_N, jnp.inf), group_id_N, num_groups)
  return _Groups(r_N, valid_N, count_B, jax.ops.segment_sum(r_N, group_id_N, num_groups), high_B == low_B)


def _keep(a_N: jax.Array, g: _Groups, group_id_N: jax.Array) -> jax.Array:
  """0 on padding rows, on every row of a group with one valid row and of a group whose rewards are equal."""
  return jnp.where(g.valid_N & (g.count_B[group_id_N] > 1) & ~g.uniform_B[group_id_N], a_N, 0.0)


def group_advantages_by_id(rewards_N: jax.Array, group_id_N: jax.Array, num_groups: int, *,
                           eps: float = 1e-6, scale: Scale = "group",
                           valid_N: jax.Array | None = None) -> jax.Array:
  """GRPO: A_i = (r_i - mean_g) / (std_g + eps) for row i of group g = group_id_N[i].

  std_g is unbiased (ddof = 1). scale="none" gives A_i = r_i - mean_g
  (Dr.GRPO); scale="batch" divides by the unbiased std of all valid rewards
  instead of std_g. A group with one valid row gets A = 0. Rows with
  valid_N False (padding rows) are left out of every statistic and get 0.
  Group ids must lie in [0, num_groups); num_groups is static. No gradient.
  """
  g = _groups(rewards_N, group_id_N, num_groups, valid_N)
  r_N, valid_N = g.r_N, g.valid_N
  mean_B = g.sum_B / jnp.maximum(g.count_B, 1.0)
  centred_N = jnp.where(valid_N, r_N - mean_B[group_id_N], 0.0)
  # Two-pass variance: sum of squared deviations, exact for 0/1 rewards.
  ssd_B = jax.ops.segment_sum(jnp.square(centred_N), group_id_N, num_groups)
  std_B = jnp.sqrt(ssd_B / jnp.maximum(g.count_B - 1.0, 1.0))
  if scale == "none":
    a_N = centred_N
  elif scale == "group":
    a_N = centred_N / (std_B[group_id_N] + eps)
  elif scale == "batch":
    n = valid_N.sum().astype(r_N.dtype)
    batch_mean = r_N.sum() / jnp.maximum(n, 1.0)
    batch_ssd = jnp.sum(jnp.where(valid_N, jnp.square(r_N - batch_mean), 0.0))
    a_N = centred_N / (jnp.sqrt(batch_ssd / jnp.maximum(n - 1.0, 1.0)) + eps)
  else:
    raise ValueError(f"scale must be group, batch or none, got {scale!r}")
  return _keep(a_N, g, group_id_N)


def rloo_advantages_by_id(rewards_N: jax.Array, group_id_N: jax.Array, num_groups: int, *,
                          valid_N: jax.Array | None = None) -> jax.Array:
  """RLOO: A_i = r_i - (sum_g - r_i) / (G_v - 1), the mean of the OTHER valid rows of group g.

  Equals G_v / (G_v - 1) * (r_i - mean_g); no std scaling. A group with one
  valid row gets A = 0; padding rows (valid_N False) count nowhere and get 0.
  No gradient.
  """
  g = _groups(rewards_N, group_id_N, num_groups, valid_N)
  others_N = jnp.maximum(g.count_B[group_id_N] - 1.0, 1.0)
  return _keep(g.r_N - (g.sum_B[group_id_N] - g.r_N) / others_N, g, group_id_N)


def reinforce_advantages_by_id(rewards_N: jax.Array, group_id_N: jax.Array, num_groups: int, *,
                               valid_N: jax.Array | None = None) -> jax.Array:
  """REINFORCE with the group-mean baseline: A_i = r_i - mean_g, no scaling.

  The same numbers as group_advantages_by_id(scale="none"). A group with one
  valid row gets A = 0; padding rows count nowhere and get 0. No gradient.
  """
  g = _groups(rewards_N, group_id_N, num_groups, valid_N)
  return _keep(g.r_N - (g.sum_B / jnp.maximum(g.count_B, 1.0))[group_id_N], g, group_id_N)


def advantages_by_id(rewards_N: jax.Array, group_id_N: jax.Array, num_groups: int, *,
                     estimator: Estimator = "grpo", eps: float = 1e-6, scale: Scale = "group",
                     valid_N: jax.Array | None = None) -> jax.Array:
  """The advantages of `estimator`; eps and scale belong to grpo (rloo and reinforce take scale="group")."""
  if estimator == "grpo":
    return group_advantages_by_id(rewards_N, group_id_N, num_groups, eps=eps, scale=scale, valid_N=valid_N)
  if estimator not in ("rloo", "reinforce"):
    raise ValueError(f"estimator must be grpo, rloo or reinforce, got {estimator!r}")
  if scale != "group":
    raise ValueError(f"scale={scale!r} applies to the grpo estimator only, not {estimator}")
  fn = rloo_advantages_by_id if estimator == "rloo" else reinforce_advantages_by_id
  return fn(rewards_N, group_id_N, num_groups, valid_N=valid_N)


def group_advantages(rewards_N: jax.Array, group_size: int, *, estimator: Estimator = "grpo",
                     eps: float = 1e-6, scale: Scale = "group", valid_N: jax.Array | None = None) -> jax.Array:
  """Advantages for rows laid out in contiguous groups: row i is in group i // group_size.

  Same equations as advantages_by_id; the train step lays out the G samples of
  each prompt next to each other (rewards_BxG = rewards_N.reshape(B, G)).
  """
  N = rewards_N.shape[0]
  if group_size < 1 or N % group_size:
    raise ValueError(f"{N} rows do not split into groups of {group_size}")
  group_id_N = jnp.arange(N) // group_size
  return advantages_by_id(rewards_N, group_id_N, N // group_size, estimator=estimator, eps=eps, scale=scale,
                          valid_N=valid_N)


def uniform_group_rows(rewards_N, group_size: int, xp=jnp):
  """[N] bool: the rows of contiguous groups whose rewards are all equal (they get A = 0). xp=numpy gives the
  host the same answer on the same float32 rewards."""
  r_BxG = xp.asarray(rewards_N, xp.float32).reshape(-1, group_size)
  return xp.repeat(xp.all(r_BxG == r_BxG[:, :1], axis=1), group_size)


def zero_std_group_fraction(rewards_N: jax.Array, group_size: int) -> jax.Array:
  """Fraction of contiguous groups whose rewards are all equal (they get A = 0 and teach nothing)."""
  return jnp.mean(uniform_group_rows(rewards_N, group_size).astype(jnp.float32))

"""Group-relative advantages: the per-row constants of the task term (SPEC section 3).

Dimension letters: B prompts (groups), G samples per prompt, N = B * G rows,

"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp


Scale = Literal["group", "batch", "none"]


def group_advantages_by_id(rewards_N: jax.Array, group_id_N: jax.Array, num_groups: int, *,
                           eps: float = 1e-6, scale: Scale = "group",
                           valid_N: jax.Array | None = None) -> jax.Array:
  """A_i = (r_i - mean_g) / (std_g + eps) for row i of group g = group_id_N[i].

  std_g is unbiased (ddof = 1). scale="none" gives A_i = r_i - mean_g
  (Dr.GRPO); scale="batch" divides by the unbiased std of all valid rewards
  instead of std_g. A group with one valid row gets A = 0. Rows with
  valid_N False (padding rows) are left out of every statistic and get 0.
  Group ids must lie in [0, num_groups); num_groups is static. No gradient.
  """
  r_N = jax.lax.stop_gradient(jnp.asarray(rewards_N, jnp.result_type(rewards_N, jnp.float32)))
  valid_N = jnp.ones(r_N.shape, bool) if valid_N is None else jnp.asarray(valid_N, bool)
  r_N = jnp.where(valid_N, r_N, 0.0)
  v_N = valid_N.astype(r_N.dtype)
  count_B = jax.ops.segment_sum(v_N, group_id_N, num_groups)
  mean_B = jax.ops.segment_sum(r_N, group_id_N, num_groups) / jnp.maximum(count_B, 1.0)
  centred_N = jnp.where(valid_N, r_N - mean_B[group_id_N], 0.0)
  # Two-pass variance: sum of squared deviations, exact for 0/1 rewards.
  ssd_B = jax.ops.segment_sum(jnp.square(centred_N), group_id_N, num_groups)
  std_B = jnp.sqrt(ssd_B / jnp.maximum(count_B - 1.0, 1.0))
  if scale == "none":
    a_N = centred_N
  elif scale == "group":
    a_N = centred_N / (std_B[group_id_N] + eps)
  elif scale == "batch":
    n = v_N.sum()
    batch_mean = r_N.sum() / jnp.maximum(n, 1.0)
    batch_ssd = jnp.sum(jnp.where(valid_N, jnp.square(r_N - batch_mean), 0.0))
    a_N = centred_N / (jnp.sqrt(batch_ssd / jnp.maximum(n - 1.0, 1.0)) + eps)
  else:
    raise ValueError(f"scale must be group, batch or none, got {scale!r}")
  return jnp.where(valid_N & (count_B[group_id_N] > 1), a_N, 0.0)


def group_advantages(rewards_N: jax.Array, group_size: int, *, eps: float = 1e-6,
                     scale: Scale = "group") -> jax.Array:
  """Group advantages for rows laid out in contiguous groups: row i is in group i // group_size.

  Same equation as group_advantages_by_id; the train step lays out the G
  samples of each prompt next to each other (rewards_BxG = rewards_N.reshape(B, G)).
  """
  N = rewards_N.shape[0]
  if group_size < 1 or N % group_size:
    raise ValueError(f"{N} rows do not split into groups of {group_size}")
  group_id_N = jnp.arange(N) // group_size
  return group_advantages_by_id(rewards_N, group_id_N, N // group_size, eps=eps, scale=scale)


def zero_std_group_fraction(rewards_N: jax.Array, group_size: int) -> jax.Array:
  """Fraction of contiguous groups whose rewards are all equal (they get A = 0 and teach nothing)."""
  r_BxG = jnp.asarray(rewards_N).reshape(-1, group_size)
  return jnp.mean(jnp.all(r_BxG == r_BxG[:, :1], axis=1).astype(jnp.float32))

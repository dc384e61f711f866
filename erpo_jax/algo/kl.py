"""KL estimators of a log-ratio and the masked per-row penalty (Query-KL on prompts, Policy-KL on responses).

Dimension letters: N rows (sequences), S sequence length. `logp_NxS[:, t]` is
log P(x_t | x_<t) (model.logprobs.log_probs), so column 0 has no log-prob: every
function here that takes log-probs ignores column 0 of its mask (SPEC: the
first prompt token never enters any sum).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

Estimator = Literal["k1", "k2", "k3"]


def k1_from_log_ratio(log_ratio: jax.Array) -> jax.Array:
  """k1(d) = d, with d = log pi(x) - log pi_ref(x). Unbiased but can be negative."""
  return log_ratio


def k2_from_log_ratio(log_ratio: jax.Array) -> jax.Array:
  """k2(d) = d^2 / 2."""
  return 0.5 * jnp.square(log_ratio)


def k3_from_log_ratio(log_ratio: jax.Array) -> jax.Array:
  """k3(d) = exp(-d) + d - 1 = expm1(-d) + d  (>= 0, zero iff d = 0).

  expm1 keeps the O(d^2) value near d = 0, where exp(-d) - 1 would cancel to 0
  or go negative (d = 1e-8 gives 5e-17 in float64). d/dd k3 = 1 - exp(-d).
  """
  return jnp.expm1(-log_ratio) + log_ratio


_ESTIMATORS = {"k1": k1_from_log_ratio, "k2": k2_from_log_ratio, "k3": k3_from_log_ratio}


def kl_estimate(log_ratio: jax.Array, estimator: Estimator = "k3") -> jax.Array:
  """k(d) for estimator in {k1, k2, k3}; the choice is static (a Python string)."""
  if estimator not in _ESTIMATORS:
    raise ValueError(f"estimator must be one of {sorted(_ESTIMATORS)}, got {estimator!r}")
  return _ESTIMATORS[estimator](log_ratio)


def scored_mask(mask_NxS: jax.Array) -> jax.Array:
  """Boolean mask with column 0 cleared: the positions that carry a next-token log-prob."""
  mask_NxS = jnp.asarray(mask_NxS).astype(bool)
  return mask_NxS.at[:, 0].set(False)


def shrink(log_ratio: jax.Array, tolerance: float) -> jax.Array:
  """sign(d) max(|d| - tolerance, 0): log-ratios within `tolerance` of 0 count as 0 (value and gradient);
  larger ones lose `tolerance`, so the penalty stays continuous. tolerance = 0 returns d unchanged."""
  if tolerance == 0:
    return log_ratio
  return jnp.sign(log_ratio) * jnp.maximum(jnp.abs(log_ratio) - tolerance, 0.0)


def token_kl(logp_NxS: jax.Array, ref_logp_NxS: jax.Array, mask_NxS: jax.Array, *,
             estimator: Estimator = "k3", log_ratio_clamp: float = 20.0,
             kl_max: float = 10.0, tolerance: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Per-token penalty k_t = min(k(clip(shrink(logp_t - sg(ref_t)), -c, c)), kl_max) on the mask, 0 elsewhere.

  Returns (k_NxS, clamped_NxS): clamped marks masked tokens where either clamp
  was active. jnp.clip/minimum give zero gradient to a clamped token; that is
  the standard choice (a clamped token stops pushing), and the clamped
  fraction is reported so it can be seen. The log-ratio is masked before any
  nonlinearity, so NaN or inf in padding reaches neither values nor gradients.
  `tolerance` (nats, see `shrink`) is the rounding between two forwards of the
  same weights in different programs (erpo.cache_tolerance); 0 is the exact
  estimator of SPEC 3.
  """
  mask_NxS = scored_mask(mask_NxS)
  raw_NxS = jnp.where(mask_NxS, logp_NxS - jax.lax.stop_gradient(ref_logp_NxS), 0.0)
  d_NxS = jnp.clip(shrink(raw_NxS, tolerance), -log_ratio_clamp, log_ratio_clamp)
  k_NxS = kl_estimate(d_NxS, estimator)
  clamped_NxS = mask_NxS & ((jnp.abs(raw_NxS) > log_ratio_clamp) | (k_NxS > kl_max))
  return jnp.where(mask_NxS, jnp.minimum(k_NxS, kl_max), 0.0), clamped_NxS


class RowKL(NamedTuple):
  """Masked KL estimate per row. Sums and counts are kept apart so batches combine exactly."""

  per_row_N: jax.Array  # sum_N / count_N, 0 for rows with no masked position
  sum_N: jax.Array  # sum of k_t over the row's masked positions
  count_N: jax.Array  # number of masked positions (float)
  clamped: jax.Array  # scalar: masked tokens where a clamp was active (float)


def row_kl(logp_NxS: jax.Array, ref_logp_NxS: jax.Array, mask_NxS: jax.Array, *,
           estimator: Estimator = "k3", log_ratio_clamp: float = 20.0, kl_max: float = 10.0) -> RowKL:
  """D(i) = (1 / |M_i|) sum_{t in M_i} k(logp_t - ref_t), M_i the masked positions of row i.

  With the prompt mask this is D_query (ERPO's Query-KL); with the response
  mask it is the GRPO policy-KL. Gradient flows through logp only; for k3,
  dD(i)/dlogp_t = (1 - exp(-d_t)) / |M_i|. Rows with |M_i| = 0 give D = 0.
  """
  k_NxS, clamped_NxS = token_kl(logp_NxS, ref_logp_NxS, mask_NxS, estimator=estimator,
                                log_ratio_clamp=log_ratio_clamp, kl_max=kl_max)
  sum_N = k_NxS.sum(axis=1)
  count_N = scored_mask(mask_NxS).sum(axis=1).astype(k_NxS.dtype)
  # count_N = 0 implies sum_N = 0, so max(count, 1) gives 0 there without NaN.
  per_row_N = sum_N / jnp.maximum(count_N, 1.0)
  return RowKL(per_row_N, sum_N, count_N, clamped_NxS.sum().astype(k_NxS.dtype))

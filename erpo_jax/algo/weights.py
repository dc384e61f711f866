"""ERPO question weights w(q) (SPEC section 2): static from the reference, dynamic from the current policy.

Dimension letters: N rows, S sequence length, Q questions of a whole data set.
s_q is a question's NLL summed over its scored prompt positions; the weight is
the mean NLL over s_q, so a question the model finds less likely than average
(s_q > s_bar) gets w < 1 and a familiar one w > 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.algo.kl import scored_mask

NLL_FLOOR = 1e-8  # s_q is floored here before dividing: a non-positive NLL gets the largest weight


def prompt_nll(logp_NxS: jax.Array, prompt_mask_NxS: jax.Array) -> tuple[jax.Array, jax.Array]:
  """s_i = -sum_{t in P_i} logp_t over the row's scored prompt positions; valid_i = |P_i| > 0.

  Column 0 is ignored (no log-prob there). Returns (nll_N, valid_N).
  """
  mask_NxS = scored_mask(prompt_mask_NxS)
  nll_N = -jnp.where(mask_NxS, logp_NxS, 0.0).sum(axis=1)
  return nll_N, mask_NxS.any(axis=1)


def nll_sum_count(nll_N: jax.Array, valid_N: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum_i valid_i * s_i, sum_i valid_i): summed over minibatches/hosts they give the global s_bar."""
  valid_N = jnp.asarray(valid_N, bool)
  return jnp.where(valid_N, nll_N, 0.0).sum(), valid_N.sum().astype(jnp.result_type(nll_N, jnp.float32))


def dynamic_weights(nll_N: jax.Array, valid_N: jax.Array, *, clip: tuple[float, float] | None = None,
                    global_mean: jax.Array | None = None) -> jax.Array:
  """w_i = sg(s_bar / max(s_i, 1e-8)), optionally clipped to [lo, hi]; rows with valid_i False get 1.

  s_i is the CURRENT policy's prompt NLL (prompt_nll). s_bar is the mean over
  the valid rows given, or `global_mean` when the caller computed it over the
  whole update batch (nll_sum_count summed over all minibatches and hosts),
  so every minibatch of an update gets the same weights.
  """
  valid_N = jnp.asarray(valid_N, bool)
  if global_mean is None:
    total, count = nll_sum_count(nll_N, valid_N)
    global_mean = total / jnp.maximum(count, 1.0)
  w_N = global_mean / jnp.maximum(nll_N, NLL_FLOOR)
  if clip is not None:
    w_N = jnp.clip(w_N, clip[0], clip[1])
  return jax.lax.stop_gradient(jnp.where(valid_N, w_N, 1.0))


def static_weights(ref_nll_Q: jax.Array, lo: float = 0.0, hi: float = 2.0) -> jax.Array:
  """w_q = clip(s_bar / max(s_q, 1e-8), lo, hi), s_q the reference NLL of question q, s_bar = mean_q s_q.

  Computed once over the whole data set (all Q questions) before training.
  A non-positive s_q is floored at 1e-8, so it gets weight hi. No gradient.
  """
  ref_nll_Q = jax.lax.stop_gradient(jnp.asarray(ref_nll_Q))
  s_bar = jnp.mean(ref_nll_Q)
  return jnp.clip(s_bar / jnp.maximum(ref_nll_Q, NLL_FLOOR), lo, hi)

"""Drawing one token per row from logits: greedy, temperature, top-k, top-p, inverse-CDF sampling.

Dimension letters: N rows, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_token(logits_NxV: jax.Array, key: jax.Array, temperature, *, greedy: bool, top_k: int,
                 top_p: float) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row; returns (token_N int32, logp_N f32).

  greedy: token = argmax logits, logp = log softmax(logits)[token] (temperature 1).
  Else tokens are drawn from q = softmax(filter(logits / temperature)): filter
  keeps the top_k largest (0 = all), then the smallest head whose q-mass
  reaches top_p (1 = all); ties with the cut-off stay. logp = log q(token), the
  tempered, filtered, renormalised distribution actually sampled from; at
  temperature 1, top_p = 1, top_k = 0 it is the model's log-prob. Branches are
  static: the plain case sorts nothing.
  """
  if greedy:
    tok = jnp.argmax(logits_NxV, axis=-1)
    logp_NxV = jax.nn.log_softmax(logits_NxV, axis=-1)
    return tok.astype(jnp.int32), jnp.take_along_axis(logp_NxV, tok[:, None], axis=-1)[:, 0]
  x = logits_NxV / temperature
  neg_inf = jnp.finfo(x.dtype).min
  sorted_desc = None
  if top_k > 0:
    sorted_desc = jax.lax.top_k(x, top_k)[0]  # [N, k], descending
    x = jnp.where(x < sorted_desc[:, -1:], neg_inf, x)
  if top_p < 1.0:
    if sorted_desc is None:
      sorted_desc = -jnp.sort(-x, axis=-1)  # the full-vocab sort only happens here
    q = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(q, axis=-1) - q
    keep = jnp.sum(mass_before < top_p, axis=-1)  # >= 1: the first token has mass_before 0
    cutoff = jnp.take_along_axis(sorted_desc, keep[:, None] - 1, axis=-1)
    x = jnp.where(x < cutoff, neg_inf, x)
  tok = categorical(key, x)
  logp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tok[:, None], axis=-1)[:, 0]
  return tok.astype(jnp.int32), logp


def categorical(key: jax.Array, logits_NxV: jax.Array, *, block: int = 128) -> jax.Array:
  """One draw per row from softmax(logits) by inverse CDF: one uniform per row, not V Gumbels.

  Dimension letters: N rows, V vocab, C blocks of `block` tokens (V padded with
  zero-mass tokens). The uniform u in [0, total mass) picks the block whose
  cumulative mass passes u, then the token inside it: two short cumulative
  sums instead of V random numbers (the Gumbel trick of jax.random.categorical
  spends most of a decode step's sampling time on them). Tokens of zero
  probability (filtered to the dtype's min) are never drawn.
  """
  N, V = logits_NxV.shape
  C = -(-V // block)
  x = logits_NxV.astype(jnp.float32)
  p_NxV = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  p_NxCxK = jnp.pad(p_NxV, ((0, 0), (0, C * block - V))).reshape(N, C, block)
  cum_NxC = jnp.cumsum(p_NxCxK.sum(axis=-1), axis=-1)
  u_N = jax.random.uniform(key, (N,), jnp.float32) * cum_NxC[:, -1]
  c_N = jnp.minimum(jnp.sum(cum_NxC <= u_N[:, None], axis=-1), C - 1)
  before_N = jnp.where(c_N > 0, jnp.take_along_axis(cum_NxC, jnp.maximum(c_N - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
  inner_NxK = jnp.cumsum(jnp.take_along_axis(p_NxCxK, c_N[:, None, None], axis=1)[:, 0], axis=-1)
  # Rounding can leave u - before at or past the block's own total: stay inside its mass.
  r_N = jnp.minimum(u_N - before_N, inner_NxK[:, -1] * (1.0 - 2.0 ** -20))
  k_N = jnp.sum(inner_NxK <= r_N[:, None], axis=-1)
  return (c_N * block + k_N).astype(jnp.int32)

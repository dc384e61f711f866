"""Drawing one token per row from logits: greedy, temperature, top-k, top-p, inverse-CDF sampling.

Dimension letters: N rows, V vocab. The decode loop's logits come column-major,
[V, N] (the lm-head as E [V, D] @ h^T [D, N], which XLA's CPU matmul runs
without repacking E), so the draws are written for that layout;
`sample_token` and `categorical` take the usual [N, V].
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
  return sample_token_columns(logits_NxV.T, key, temperature, greedy=greedy, top_k=top_k, top_p=top_p)


def sample_token_columns(logits_VxN: jax.Array, key: jax.Array, temperature, *, greedy: bool, top_k: int,
                         top_p: float) -> tuple[jax.Array, jax.Array]:
  """`sample_token` of column-major logits [V, N]: one draw per column."""
  pick = lambda a_VxN, tok_N: jnp.take_along_axis(a_VxN, tok_N[None], axis=0)[0]
  if greedy:
    tok = jnp.argmax(logits_VxN, axis=0)
    return tok.astype(jnp.int32), pick(jax.nn.log_softmax(logits_VxN, axis=0), tok)
  x = logits_VxN / temperature
  neg_inf = jnp.finfo(x.dtype).min
  sorted_desc = None  # [N, k]: sorting runs along the last axis
  if top_k > 0:
    sorted_desc = jax.lax.top_k(x.T, top_k)[0]
    x = jnp.where(x < sorted_desc[:, -1][None], neg_inf, x)
  if top_p < 1.0:
    if sorted_desc is None:
      sorted_desc = -jnp.sort(-x.T, axis=-1)  # the full-vocab sort only happens here
    q = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(q, axis=-1) - q
    keep = jnp.sum(mass_before < top_p, axis=-1)  # >= 1: the first token has mass_before 0
    cutoff = jnp.take_along_axis(sorted_desc, keep[:, None] - 1, axis=-1)[:, 0]
    x = jnp.where(x < cutoff[None], neg_inf, x)
  return draw_columns(key, x)


def categorical(key: jax.Array, logits_NxV: jax.Array, *, block: int = 128) -> jax.Array:
  """One draw per row from softmax(logits); see `categorical_columns`."""
  return categorical_columns(key, logits_NxV.T, block=block)


def categorical_columns(key: jax.Array, logits_VxN: jax.Array, *, block: int = 128) -> jax.Array:
  """One draw per column from softmax(logits); see `draw_columns`."""
  return draw_columns(key, logits_VxN, block=block)[0]


def draw_columns(key: jax.Array, logits_VxN: jax.Array, *, block: int = 128) -> tuple[jax.Array, jax.Array]:
  """One draw per column from softmax(logits) by inverse CDF: one uniform per column, not V Gumbels.
  Returns (token_N int32, logp_N f32), logp = log softmax(logits)[token] as log(the token's mass) -
  log(the total mass), both from the one exp pass that draws it.

  Dimension letters: V vocab, N columns, C blocks of `block` tokens (V padded
  with zero-mass tokens). The uniform u in [0, total mass) picks the block
  whose cumulative mass passes u, then the token inside it: two short
  cumulative sums instead of V random numbers (the Gumbel trick of
  jax.random.categorical spends most of a decode step's sampling time on them).
  Tokens of zero probability (filtered to the dtype's min) are never drawn.
  """
  V, N = logits_VxN.shape
  C = -(-V // block)
  x = logits_VxN.astype(jnp.float32)
  p_VxN = jnp.exp(x - jnp.max(x, axis=0, keepdims=True))
  p_CxKxN = jnp.pad(p_VxN, ((0, C * block - V), (0, 0))).reshape(C, block, N)
  cum_CxN = jnp.cumsum(p_CxKxN.sum(axis=1), axis=0)
  u_N = jax.random.uniform(key, (N,), jnp.float32) * cum_CxN[-1]
  c_N = jnp.minimum(jnp.sum(cum_CxN <= u_N[None], axis=0), C - 1)
  before_N = jnp.where(c_N > 0, jnp.take_along_axis(cum_CxN, jnp.maximum(c_N - 1, 0)[None], axis=0)[0], 0.0)
  p_KxN = jnp.take_along_axis(p_CxKxN, c_N[None, None], axis=0)[0]
  inner_KxN = jnp.cumsum(p_KxN, axis=0)
  # Rounding can leave u - before at or past the block's own total: stay inside its mass.
  r_N = jnp.minimum(u_N - before_N, inner_KxN[-1] * (1.0 - 2.0 ** -20))
  k_N = jnp.sum(inner_KxN <= r_N[None], axis=0)
  mass_N = jnp.take_along_axis(p_KxN, k_N[None], axis=0)[0]  # > 0: a zero-mass token is never drawn
  return (c_N * block + k_N).astype(jnp.int32), jnp.log(mass_N) - jnp.log(cum_CxN[-1])

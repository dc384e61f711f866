"""The decode KV cache: one layer's keys and values, and one query per row attending over them.

Dimension letters: N rows, K key/value heads, H query heads, Dh head dim, T cache slots.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
  """One layer's keys [N, K, Dh, T] and values [N, K, T, Dh] (heads first: a row's head reads its
  slots as one contiguous block). Keys put the slot axis last, so a decode step's scores are
  Dh vector multiply-adds over T contiguous slots, not N*K tiny matmuls. A model's cache is a
  list of L of them: separate buffers, so a decode step updates each in place."""

  k: jax.Array  # [N, K, Dh, T]
  v: jax.Array  # [N, K, T, Dh]

  @staticmethod
  def from_prompt(k_NxPxKxDh: jax.Array, v_NxPxKxDh: jax.Array) -> "KVCache":
    """P tokens' keys and values, as the projections give them, in the cache's layout."""
    return KVCache(jnp.transpose(k_NxPxKxDh, (0, 2, 3, 1)), jnp.swapaxes(v_NxPxKxDh, 1, 2))

  def with_slots(self, extra: int) -> "KVCache":
    """The same cache with `extra` empty slots after its T."""
    return KVCache(jnp.pad(self.k, ((0, 0), (0, 0), (0, 0), (0, extra))),
                   jnp.pad(self.v, ((0, 0), (0, 0), (0, extra), (0, 0))))

  def write(self, k_Nx1xKxDh: jax.Array, v_Nx1xKxDh: jax.Array, slot) -> "KVCache":
    """Writes one token per row into slot `slot` (the same slot for every row), in place."""
    new = KVCache.from_prompt(k_Nx1xKxDh, v_Nx1xKxDh)
    return KVCache(jax.lax.dynamic_update_slice(self.k, new.k, (0, 0, 0, slot)),
                   jax.lax.dynamic_update_slice(self.v, new.v, (0, 0, slot, 0)))


def decode_attention(q_NxHxDh, k_NxKxDhxT, v_NxKxTxDh, attend_NxT):
  """One query per row over the cache slots attend_NxT marks; float32 scores and softmax.

  The scores are a sum over Dh of q times the keys' slot rows (T contiguous values each):
  one fused loop, where a batched dot would run N*K matmuls of [H/K, Dh] x [Dh, T].
  """
  N, H, Dh = q_NxHxDh.shape
  K = k_NxKxDhxT.shape[1]
  f32 = jnp.float32
  q = q_NxHxDh.reshape(N, K, H // K, Dh).astype(f32)
  scores = jnp.sum(q[..., None] * k_NxKxDhxT[:, :, None].astype(f32), axis=3) / math.sqrt(Dh)
  probs = jax.nn.softmax(jnp.where(attend_NxT[:, None, None, :], scores, jnp.finfo(f32).min), axis=-1)
  o = jnp.einsum("nkgt,nktd->nkgd", probs.astype(v_NxKxTxDh.dtype), v_NxKxTxDh, preferred_element_type=f32)
  return o.astype(q_NxHxDh.dtype).reshape(N, H, Dh)

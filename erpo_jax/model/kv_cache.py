"""The decode KV cache: one layer's keys and values, and one query per row attending over them.

Dimension letters: N rows, B prompts, G rows per prompt (N = B*G, row n = b*G + g), K key/value heads,
H query heads, Dh head dim, T cache slots, P prompt slots, M response slots (T = P + M).

Two forms, with the same `write` and `attend`: `KVCache` holds every slot of every row; `GroupKVCache`
holds the prompt's slots once per prompt and only the response slots per row. A sampler that draws G
responses to each prompt repeats nothing: each decode step reads a prompt's keys and values once for
its G rows instead of G times.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

_F32 = jnp.float32


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

  def attend(self, q_NxHxDh: jax.Array, attend_NxT: jax.Array) -> jax.Array:
    """`decode_attention` over this cache."""
    return decode_attention(q_NxHxDh, self.k, self.v, attend_NxT)


class GroupKVCache(NamedTuple):
  """One layer's cache for G rows per prompt: the prompt's keys [B, K, Dh, P] and values [B, K, P, Dh]
  once per prompt, the response's keys [N, K, Dh, M] and values [N, K, M, Dh] per row. Slots are
  numbered as in a `KVCache` of T = P + M slots: [0, P) the prompt, [P, T) the response."""

  prompt: KVCache  # B rows, P slots
  response: KVCache  # N rows, M slots

  @staticmethod
  def for_groups(prompt: KVCache, group_size: int, response_slots: int) -> "GroupKVCache":
    """The prompts' cache (B rows), with `response_slots` empty slots for each of its G rows."""
    B, K, Dh, _ = prompt.k.shape
    N, M, dt = B * group_size, response_slots, prompt.k.dtype
    return GroupKVCache(prompt, KVCache(jnp.zeros((N, K, Dh, M), dt), jnp.zeros((N, K, M, Dh), dt)))

  def write(self, k_Nx1xKxDh: jax.Array, v_Nx1xKxDh: jax.Array, slot) -> "GroupKVCache":
    """Writes one token per row into response slot `slot` (>= P), in place."""
    P = self.prompt.k.shape[-1]
    return GroupKVCache(self.prompt, self.response.write(k_Nx1xKxDh, v_Nx1xKxDh, slot - P))

  def attend(self, q_NxHxDh: jax.Array, attend_NxT: jax.Array) -> jax.Array:
    """`group_decode_attention` over this cache."""
    return group_decode_attention(q_NxHxDh, self.prompt.k, self.prompt.v, self.response.k, self.response.v,
                                  attend_NxT)


def _scores(q_NxKxgxDh, k_NxKxDhxT):
  """Scores [N, K, g, T]: a sum over Dh of q times the keys' slot rows (T contiguous values each), one fused
  loop, where a batched dot would run N*K matmuls of [g, Dh] x [Dh, T]."""
  return jnp.sum(q_NxKxgxDh[..., None] * k_NxKxDhxT[:, :, None].astype(_F32), axis=3)


def _masked_softmax(scores, attend_NxT):
  return jax.nn.softmax(jnp.where(attend_NxT[:, None, None, :], scores, jnp.finfo(_F32).min), axis=-1)


def decode_attention(q_NxHxDh, k_NxKxDhxT, v_NxKxTxDh, attend_NxT):
  """One query per row over the cache slots attend_NxT marks; float32 scores and softmax."""
  N, H, Dh = q_NxHxDh.shape
  K = k_NxKxDhxT.shape[1]
  q = q_NxHxDh.reshape(N, K, H // K, Dh).astype(_F32)
  probs = _masked_softmax(_scores(q, k_NxKxDhxT) / math.sqrt(Dh), attend_NxT)
  o = jnp.einsum("nkgt,nktd->nkgd", probs.astype(v_NxKxTxDh.dtype), v_NxKxTxDh, preferred_element_type=_F32)
  return o.astype(q_NxHxDh.dtype).reshape(N, H, Dh)


def group_decode_attention(q_NxHxDh, pk_BxKxDhxP, pv_BxKxPxDh, k_NxKxDhxM, v_NxKxMxDh, attend_NxT):
  """`decode_attention` over P prompt slots held once per prompt (rows b*G .. b*G + G-1 share prompt b's) and
  M response slots per row: one softmax over all P + M slots; attend_NxT marks the slots as in a KVCache."""
  N, H, Dh = q_NxHxDh.shape
  B, K, _, P = pk_BxKxDhxP.shape
  G, g = N // B, H // K
  q = q_NxHxDh.reshape(N, K, g, Dh).astype(_F32)
  # A prompt's G*g queries of each kv head against its P keys: one [G*g, Dh] x [Dh, P] product per (b, k).
  q_BxKxGgxDh = jnp.transpose(q.reshape(B, G, K, g, Dh), (0, 2, 1, 3, 4)).reshape(B, K, G * g, Dh)
  sp = jnp.einsum("bkqd,bkdp->bkqp", q_BxKxGgxDh, pk_BxKxDhxP.astype(_F32))
  sp_NxKxgxP = jnp.transpose(sp.reshape(B, K, G, g, P), (0, 2, 1, 3, 4)).reshape(N, K, g, P)
  scores = jnp.concatenate([sp_NxKxgxP, _scores(q, k_NxKxDhxM)], axis=-1) / math.sqrt(Dh)
  probs = _masked_softmax(scores, attend_NxT)
  pp = jnp.transpose(probs[..., :P].reshape(B, G, K, g, P), (0, 2, 1, 3, 4)).reshape(B, K, G * g, P)
  op = jnp.einsum("bkqp,bkpd->bkqd", pp.astype(pv_BxKxPxDh.dtype), pv_BxKxPxDh, preferred_element_type=_F32)
  op_NxKxgxDh = jnp.transpose(op.reshape(B, K, G, g, Dh), (0, 2, 1, 3, 4)).reshape(N, K, g, Dh)
  o = op_NxKxgxDh + jnp.einsum("nkgt,nktd->nkgd", probs[..., P:].astype(v_NxKxMxDh.dtype), v_NxKxMxDh,
                               preferred_element_type=_F32)
  return o.astype(q_NxHxDh.dtype).reshape(N, H, Dh)

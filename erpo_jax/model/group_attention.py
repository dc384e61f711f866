"""Softmax attention of a group's response rows over its shared prompt's keys (stored once) and their own.

Dimension letters: B prompts, G rows per prompt, N = B*G rows (row n belongs to prompt n // G), P prompt bucket,
R response bucket, H query heads, K key/value heads, Dh head dim.

On one CPU device in float32 the forward and backward run in `cpu_kernel`'s library (`cpu_decode.cc`, "The
update's attention"): XLA's batched products of [R, Dh] blocks ran at a third of the matmul peak or less, with a
transpose of the queries, keys and output around them in each direction. Everywhere else XLA's ops run.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from erpo_jax.model import cpu_kernel


def group_attention(q_NxRxHxDh: jax.Array, kp_BxPxKxDh: jax.Array, vp_BxPxKxDh: jax.Array,
                    kr_NxRxKxDh: jax.Array, vr_NxRxKxDh: jax.Array, prompt_len_B: jax.Array,
                    group_size: int, *, kernel: bool | None = None) -> jax.Array:
  """Softmax attention of response queries over [their group's prompt keys, causal response keys].

  Row n = b*G + g sees prompt keys j < prompt_len[b] (stored once) and its own response keys r' <= r;
  scores and softmax in float32. kernel: None = the CPU kernel where `cpu_kernel.usable` says so.
  """
  if kernel is None:
    kernel = cpu_kernel.usable(q_NxRxHxDh.dtype)
  if kernel:
    if q_NxRxHxDh.shape[0] != group_size * kp_BxPxKxDh.shape[0]:
      raise ValueError(f"group_attention: {q_NxRxHxDh.shape[0]} rows are not {kp_BxPxKxDh.shape[0]} groups of "
                       f"{group_size}")
    return _kernel_attention(q_NxRxHxDh, kp_BxPxKxDh, vp_BxPxKxDh, kr_NxRxKxDh, vr_NxRxKxDh,
                             prompt_len_B.astype(jnp.int32))
  return xla_group_attention(q_NxRxHxDh, kp_BxPxKxDh, vp_BxPxKxDh, kr_NxRxKxDh, vr_NxRxKxDh, prompt_len_B,
                             group_size)


def xla_group_attention(q_NxRxHxDh, kp_BxPxKxDh, vp_BxPxKxDh, kr_NxRxKxDh, vr_NxRxKxDh, prompt_len_B, group_size):
  """`group_attention` in XLA's ops. Every product batches over (b, g, k) in XLA's own axis order, so the
  queries and the output are transposed once; one log-sum-exp covers both key sets (no concatenation)."""
  N, R, H, Dh = q_NxRxHxDh.shape
  B, P, K, _ = kp_BxPxKxDh.shape
  G = group_size
  f32 = jnp.float32
  q = q_NxRxHxDh.reshape(B, G, R, K, H // K, Dh).transpose(0, 1, 3, 4, 2, 5)  # [B, G, K, H/K, R, Dh]
  kp, vp = (jnp.broadcast_to(x.transpose(0, 2, 1, 3)[:, None], (B, G, K, P, Dh)) for x in (kp_BxPxKxDh, vp_BxPxKxDh))
  kr, vr = (x.reshape(B, G, R, K, Dh).transpose(0, 1, 3, 2, 4) for x in (kr_NxRxKxDh, vr_NxRxKxDh))  # [B,G,K,R,Dh]
  scale = 1.0 / math.sqrt(Dh)
  scores_p = jnp.einsum("bgkhrd,bgkpd->bgkhrp", q, kp, preferred_element_type=f32) * scale
  scores_r = jnp.einsum("bgkhrd,bgktd->bgkhrt", q, kr, preferred_element_type=f32) * scale
  mask_p = (jnp.arange(P)[None, :] < prompt_len_B[:, None])[:, None, None, None, None, :]  # [B, 1, 1, 1, 1, P]
  mask_r = jnp.tril(jnp.ones((R, R), bool))
  scores_p, scores_r = (jnp.where(m, x, jnp.finfo(f32).min) for m, x in ((mask_p, scores_p), (mask_r, scores_r)))
  top = jax.lax.stop_gradient(jnp.maximum(scores_p.max(-1, keepdims=True), scores_r.max(-1, keepdims=True)))
  lse = top + jnp.log(sum(jnp.exp(x - top).sum(-1, keepdims=True) for x in (scores_p, scores_r)))
  probs_p, probs_r = (jnp.exp(x - lse).astype(vr.dtype) for x in (scores_p, scores_r))
  o = (jnp.einsum("bgkhrp,bgkpd->bgkhrd", probs_p, vp, preferred_element_type=f32)
       + jnp.einsum("bgkhrt,bgktd->bgkhrd", probs_r, vr, preferred_element_type=f32))  # [B, G, K, H/K, R, Dh]
  return o.astype(vr.dtype).transpose(0, 1, 4, 2, 3, 5).reshape(N, R, H, Dh)


def _kernel_forward(q, kp, vp, kr, vr, prompt_len_B):
  """(output [N, R, H, Dh], log-sum-exp [N, R, H]) from the kernel."""
  cpu_kernel.require()
  N, R, H, _ = q.shape
  shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((N, R, H), jnp.float32))
  return jax.ffi.ffi_call(cpu_kernel.TRAIN_ATTENTION_TARGETS[0], shapes, vmap_method="sequential")(
      q, kp, vp, kr, vr, prompt_len_B)


@jax.custom_vjp
def _kernel_attention(q, kp, vp, kr, vr, prompt_len_B):
  return _kernel_forward(q, kp, vp, kr, vr, prompt_len_B)[0]


def _kernel_fwd(q, kp, vp, kr, vr, prompt_len_B):
  # The output and log-sum-exp are named as the "dots" remat policy's saved values: the backward reads them
  # instead of running the forward again (4.7 MB a layer at 32 rows of 64 positions, 9 heads of 64).
  o, lse = (checkpoint_name(x, "dense") for x in _kernel_forward(q, kp, vp, kr, vr, prompt_len_B))
  return o, (q, kp, vp, kr, vr, prompt_len_B, o, lse)


def _kernel_bwd(res, do):
  q, kp, vp, kr, vr, prompt_len_B, o, lse = res
  shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, kp, vp, kr, vr))
  grads = jax.ffi.ffi_call(cpu_kernel.TRAIN_ATTENTION_TARGETS[1], shapes, vmap_method="sequential")(
      q, kp, vp, kr, vr, prompt_len_B, o, lse, do.astype(jnp.float32))
  return (*grads, None)


_kernel_attention.defvjp(_kernel_fwd, _kernel_bwd)

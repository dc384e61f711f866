"""Per-token log-probs through the lm-head, C tokens at a time: never the full [M, V] logits.

Dimension letters: M tokens, D hidden, V vocab, C tokens per chunk, n chunks.

One custom VJP covers the whole chunk loop. Forward: each chunk's float32 logits z = W h^T / T, their
log-sum-exp, the target's log-prob and, when asked, the entropy; a chunk keeps its log-sum-exp ([C]) and, while
all chunks' logits fit in KEPT_LOGITS_BYTES, its logits too. Backward: the loop again, each chunk's logits read
back (or recomputed: a fourth product the size of the forward's), its cotangent rounded once to the compute
dtype, and the unembedding's gradient summed in float32 over the chunks, returned once in W's own dtype.
Autodiff of the loop would sum that gradient in the dtype W has inside it: in bfloat16 the sum of n chunks loses
precision as n grows.
The logits are W [V, D] @ h^T [D, C] (column-major): XLA's CPU streams W in place and the weight gradient comes
out as [V, D], with no transpose of a [V, D]-sized operand.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from erpo_jax.model import cpu_bf16

CPU_CHUNK = 128  # tokens: on a CPU larger chunks measured slower (their [V, C] logits leave the caches)
ACCELERATOR_CHUNK_BYTES = 1 << 30  # a chunk's float32 logits on a GPU or TPU
# The forward keeps every chunk's float32 logits for the backward up to this size: on a CPU the lm-head's
# forward and backward of 1,408 tokens against V 49,152 then take 0.8x the time, for 277 MB kept.
KEPT_LOGITS_BYTES = 1 << 30


def chunk_tokens(chunk: int | str, vocab_size: int, backend: str | None = None) -> int:
  """Tokens per lm-head chunk: `chunk` itself, or for "auto" CPU_CHUNK on a CPU and, on an accelerator, the
  largest multiple of 128 whose float32 logits [V, C] fit in ACCELERATOR_CHUNK_BYTES (at least 128). Each chunk
  pays work the size of W (its gradient's sum, XLA's padding of W for the product), and narrow products run
  below an accelerator's peak."""
  if chunk != "auto":
    return int(chunk)
  if (backend or jax.default_backend()) == "cpu":
    return CPU_CHUNK
  return max(128, ACCELERATOR_CHUNK_BYTES // (4 * vocab_size) // 128 * 128)


def token_log_probs(h_MxD: jax.Array, w_VxD: jax.Array, targets_M: jax.Array, *, chunk: int | str,
                    temperature: float | jax.Array = 1.0, with_entropy: bool = False,
                    keep_logits: bool | None = None):
  """log softmax(h W^T / T)[target] for M tokens, C = chunk_tokens(chunk, V) at a time.

  w_VxD is the unembedding as rows (`Transformer.unembed_rows`), in any dtype: the products run in h's dtype
  and W's gradient comes back in W's dtype, summed in float32. `temperature` is one number or one per token
  ([M]); it gets no gradient. keep_logits: whether a differentiated call keeps the logits for the backward
  (None: while they fit in KEPT_LOGITS_BYTES). Returns (logp_M, entropy_M or None), float32.
  """
  M, D = h_MxD.shape
  C = max(1, min(chunk_tokens(chunk, w_VxD.shape[0]), M))  # M = 0 (rows of one token): empty results
  n = -(-M // C)
  pad = n * C - M
  h_nxCxD = jnp.pad(h_MxD, ((0, pad), (0, 0))).reshape(n, C, D)
  t_nxC = jnp.pad(targets_M, (0, pad)).reshape(n, C)
  temp_nxC = jnp.pad(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (M,)), (0, pad),
                     constant_values=1.0).reshape(n, C)
  if keep_logits is None:
    keep_logits = n * C * w_VxD.shape[0] * 4 <= KEPT_LOGITS_BYTES
  logp, ent = _chunked(with_entropy, keep_logits, w_VxD, h_nxCxD, t_nxC, temp_nxC)
  logp, ent = logp.reshape(-1)[:M], ent.reshape(-1)[:M]
  return logp, (ent if with_entropy else None)


def _logits(w_VxD, h_CxD, temp_C):
  """z [V, C] = W h^T / T in float32."""
  return cpu_bf16.lm_head_logits(w_VxD, h_CxD) / temp_C[None]


def _forward(with_entropy, keep_logits, w_VxD, h_nxCxD, t_nxC, temp_nxC):
  """(logp, entropy, log-sum-exp), each [n, C], and the logits [n, V, C] if keep_logits else None."""
  w_VxD = w_VxD.astype(h_nxCxD.dtype)

  def one(x):
    h_CxD, t_C, temp_C = x
    z_VxC = _logits(w_VxD, h_CxD, temp_C)
    lse_C = jax.nn.logsumexp(z_VxC, axis=0)
    logp_C = jnp.take_along_axis(z_VxC, t_C[None], axis=0)[0] - lse_C
    ent_C = (lse_C - jnp.sum(jnp.exp(z_VxC - lse_C[None]) * z_VxC, axis=0) if with_entropy
             else jnp.zeros_like(logp_C))
    return logp_C, ent_C, lse_C, (z_VxC if keep_logits else None)

  return jax.lax.map(one, (h_nxCxD, t_nxC, temp_nxC))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(with_entropy, keep_logits, w_VxD, h_nxCxD, t_nxC, temp_nxC):
  return _forward(with_entropy, False, w_VxD, h_nxCxD, t_nxC, temp_nxC)[:2]


def _chunked_fwd(with_entropy, keep_logits, w_VxD, h_nxCxD, t_nxC, temp_nxC):
  logp, ent, lse, z_nxVxC = _forward(with_entropy, keep_logits, w_VxD, h_nxCxD, t_nxC, temp_nxC)
  return (logp, ent), (w_VxD, h_nxCxD, t_nxC, temp_nxC, lse, ent, z_nxVxC)


def _chunked_bwd(with_entropy, keep_logits, res, g):
  w_in, h_nxCxD, t_nxC, temp_nxC, lse_nxC, ent_nxC, z_nxVxC = res
  g_logp_nxC, g_ent_nxC = g
  w_VxD = w_in.astype(h_nxCxD.dtype)
  V = w_VxD.shape[0]

  def one(dw_VxD, x):
    h_CxD, t_C, temp_C, lse_C, ent_C, g_logp_C, g_ent_C, z_VxC = x
    if z_VxC is None:
      z_VxC = _logits(w_VxD, h_CxD, temp_C)
    p_VxC = jnp.exp(z_VxC - lse_C[None])  # the forward's log-sum-exp: no reduction over V here
    # d logp / dz = onehot(t) - p;  d entropy / dz = -p (z - sum(p z)), sum(p z) = lse - entropy
    dz_VxC = g_logp_C[None] * (jnp.where(jnp.arange(V)[:, None] == t_C[None], 1.0, 0.0) - p_VxC)
    if with_entropy:
      dz_VxC = dz_VxC - g_ent_C[None] * p_VxC * (z_VxC - (lse_C - ent_C)[None])
    # The raw logits' cotangent, rounded once and stored: a product that fused its producer would recompute it.
    g_VxC = jax.lax.optimization_barrier((dz_VxC / temp_C[None]).astype(h_CxD.dtype))
    dw_C, dh_CxD = cpu_bf16.lm_head_grads(w_VxD, h_CxD, g_VxC)
    return dw_VxD + dw_C, dh_CxD.astype(h_CxD.dtype)

  dw_VxD, dh_nxCxD = jax.lax.scan(one, jnp.zeros_like(w_in, dtype=jnp.float32),
                                  (h_nxCxD, t_nxC, temp_nxC, lse_nxC, ent_nxC, g_logp_nxC, g_ent_nxC, z_nxVxC))
  return dw_VxD.astype(w_in.dtype), dh_nxCxD, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)

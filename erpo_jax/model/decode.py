"""One decode token step per layer, with activations column-major: [D, N], one column per row.

Dimension letters: N rows, D hidden, H query heads, K key/value heads, Dh head
dim, F MLP width, T cache slots.

A decode step multiplies N (a few dozen) rows by every weight matrix. XLA's
CPU backend runs x [N, in] @ W [in, out] by repacking W for every call, which
at small N costs about as much as the product; W^T [out, in] @ x^T [in, N]
streams W in place and packs only the small x^T. So the per-layer weights are
transposed once per `generate` (`decode_layers`), and the activations stay
transposed through the layer; only the attention and the cache write see the
[N, ...] layout, as small transposes.

On one CPU device in float32 the products run through our own kernel instead
(`cpu_kernel`): `decode_layers` packs each matrix into its panels, once per
`generate`, in place of the transpose, and `mm` calls the kernel; the sampler's
cache is then a `cpu_kernel.GroupCache`, whose attention the kernel runs too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from erpo_jax.model import cpu_kernel
from erpo_jax.model.cpu_bf16 import matmul_rounded
from erpo_jax.model.kv_cache import GroupKVCache, KVCache

_NAMES = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"]


def decode_layers(layer_params: dict, num_layers: int, dtype) -> list[dict]:
  """Each layer's weights as arrays of their own, matrices as [out, in] in the compute dtype (or packed for
  `cpu_kernel` where it applies).

  Decoding with the layer scan would slice, i.e. copy, each layer's weights
  out of the stacked params on every token step; these copies are made once
  per loop and then read in place.
  """
  kernel = cpu_kernel.usable(dtype)
  # Each matrix as [L, in, out] (wq is [L, D, H, Dh], wo [L, H, Dh, D]); the kernel packs layer i from the stack.
  as_matrices = lambda n, w: w.reshape(w.shape[0], -1, w.shape[-1]) if n == "wo" else w.reshape(*w.shape[:2], -1)
  stacks = {n: as_matrices(n, w).astype(dtype) for n, w in layer_params.items() if n in _NAMES}
  layers = []
  for i in range(num_layers):
    out = {n: w[i] for n, w in layer_params.items() if n not in _NAMES}
    for n, w in stacks.items():
      out[n] = cpu_kernel.pack(w, i) if kernel else w[i].T
    layers.append(out)
  return layers


def mm(w_OxI: jax.Array | cpu_kernel.Panels, xT_IxN: jax.Array) -> jax.Array:
  """W @ x^T of a `decode_layers` matrix: [out, N]."""
  if isinstance(w_OxI, cpu_kernel.Panels):
    return cpu_kernel.matmul(w_OxI, xT_IxN)
  return matmul_rounded(w_OxI, xT_IxN)


def rms_norm_cols(xT_DxN: jax.Array, w_D: jax.Array, eps: float) -> jax.Array:
  """`llama.rms_norm` of each column. The mean of squares is a [1, D] x [D, N] product: XLA's CPU reduction
  over the major axis ran as a reduce-window, about 3% of a decode step at 32 rows."""
  x32 = xT_DxN.astype(jnp.float32)
  ms = jnp.matmul(jnp.full((1, x32.shape[0]), 1.0 / x32.shape[0], jnp.float32), x32 * x32)
  y = x32 * jax.lax.rsqrt(ms + eps)
  return (y * w_D.astype(jnp.float32)[:, None]).astype(xT_DxN.dtype)


def rope_cols(xT_HxDhxN: jax.Array, cosT_1xDhxN: jax.Array, sinT_1xDhxN: jax.Array) -> jax.Array:
  """`llama.apply_rope` of column-major heads (half-split layout)."""
  x = xT_HxDhxN.astype(jnp.float32)
  half = x.shape[1] // 2
  rotated = jnp.concatenate([-x[:, half:], x[:, :half]], axis=1)
  return (x * cosT_1xDhxN + rotated * sinT_1xDhxN).astype(xT_HxDhxN.dtype)


def rope_tables_cols(cos_Nx1x1xDh: jax.Array, sin_Nx1x1xDh: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`llama.rope_tables` of one position per row as `rope_cols` (and the kernel) read them: [1, Dh, N]."""
  cols = lambda x: jnp.transpose(x[:, 0], (1, 2, 0))
  return cols(cos_Nx1x1xDh), cols(sin_Nx1x1xDh)


def decode_layer(hT_DxN: jax.Array, p: dict, cache: KVCache | GroupKVCache | cpu_kernel.GroupCache,
                 cosT_1xDhxN: jax.Array, sinT_1xDhxN: jax.Array, slot, attend_NxT: jax.Array, cfg):
  """One layer of `Transformer.decode` on hT [D, N] with `decode_layers` weights p; the new token's key and
  value go into cache slot `slot` first (with a `cpu_kernel.GroupCache`, the kernel writes and attends in one
  call). Returns (next hT, the updated cache)."""
  D, N = hT_DxN.shape
  H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  dt = hT_DxN.dtype
  x = rms_norm_cols(hT_DxN, p["attn_norm"], cfg.rms_norm_eps)
  qT, kT, vT = mm(p["wq"], x), mm(p["wk"], x), mm(p["wv"], x)  # [H*Dh, N], [K*Dh, N], [K*Dh, N]
  if cfg.attention_bias:
    qT = qT + p["bq"].astype(dt).reshape(-1, 1)
    kT = kT + p["bk"].astype(dt).reshape(-1, 1)
    vT = vT + p["bv"].astype(dt).reshape(-1, 1)
  if isinstance(cache, cpu_kernel.GroupCache):  # the kernel applies RoPE as it reads q and k
    oT, cache = cpu_kernel.group_attention(qT, kT, vT, cosT_1xDhxN[0], sinT_1xDhxN[0], cache, attend_NxT, slot)
  else:
    qT = rope_cols(qT.reshape(H, Dh, N), cosT_1xDhxN, sinT_1xDhxN)
    kT = rope_cols(kT.reshape(K, Dh, N), cosT_1xDhxN, sinT_1xDhxN)
    rows = lambda xT_HxDhxN: jnp.transpose(xT_HxDhxN, (2, 0, 1))  # [N, H, Dh]
    cache = cache.write(rows(kT)[:, None], rows(vT.reshape(K, Dh, N))[:, None], slot)
    oT = cache.attend(rows(qT), attend_NxT).reshape(N, H * Dh).T
  hT_DxN = hT_DxN + mm(p["wo"], oT.astype(dt))
  x = rms_norm_cols(hT_DxN, p["mlp_norm"], cfg.rms_norm_eps)
  gT, uT = mm(p["w_gate"], x), mm(p["w_up"], x)  # [F, N]
  return hT_DxN + mm(p["w_down"], jax.nn.silu(gT) * uT), cache

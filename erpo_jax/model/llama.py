"""Flax NNX Llama-family decoder with layer-stacked weights and a KV cache (log-probs: `lm_head`).

Dimension letters: N rows (sequences), S sequence length, T cache length,
D hidden, H query heads, K key/value heads, Dh head dim, F MLP width, V vocab,
L layers.

Weights of all layers are stacked on a leading L axis and applied with one
`lax.scan`, so a 30-layer model compiles as fast as a 1-layer one; only the
one-token decode step runs its layers unrolled over per-layer buffers. Every
parameter carries logical axis names (`axes` metadata) that
`erpo_jax.parallel.mesh` maps onto a device mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from erpo_jax.model import cpu_bf16, cpu_kernel
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.decode import decode_layer, decode_layers, rms_norm_cols, rope_tables_cols
from erpo_jax.model.kv_cache import GroupKVCache, KVCache

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def as_dtype(name_or_dtype) -> jnp.dtype:
  if isinstance(name_or_dtype, str):
    return _DTYPES[name_or_dtype]
  return jnp.dtype(name_or_dtype)


class Transformer(nnx.Module):
  """Decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype="float32", param_dtype="float32",
               remat: bool | str = False):
    self.cfg = cfg
    self.dtype = as_dtype(dtype)
    self.remat = remat
    pd = as_dtype(param_dtype)
    L, D, H, K, Dh, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            cfg.intermediate_size, cfg.vocab_size)

    def normal(shape, fan_in, axes):
      w = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
      return nnx.Param(w.astype(pd), axes=axes)

    def ones(shape, axes):
      return nnx.Param(jnp.ones(shape, pd), axes=axes)

    def zeros(shape, axes):
      return nnx.Param(jnp.zeros(shape, pd), axes=axes)

    self.embed = normal((V, D), 1.0, ("vocab", "embed"))
    self.wq = normal((L, D, H, Dh), D, ("layers", "embed", "heads", "head_dim"))
    self.wk = normal((L, D, K, Dh), D, ("layers", "embed", "kv_heads", "head_dim"))
    self.wv = normal((L, D, K, Dh), D, ("layers", "embed", "kv_heads", "head_dim"))
    self.wo = normal((L, H, Dh, D), H * Dh, ("layers", "heads", "head_dim", "embed"))
    if cfg.attention_bias:
      self.bq = zeros((L, H, Dh), ("layers", "heads", "head_dim"))
      self.bk = zeros((L, K, Dh), ("layers", "kv_heads", "head_dim"))
      self.bv = zeros((L, K, Dh), ("layers", "kv_heads", "head_dim"))
    self.w_gate = normal((L, D, F), D, ("layers", "embed", "mlp"))
    self.w_up = normal((L, D, F), D, ("layers", "embed", "mlp"))
    self.w_down = normal((L, F, D), F, ("layers", "mlp", "embed"))
    self.attn_norm = ones((L, D), ("layers", "norm"))
    self.mlp_norm = ones((L, D), ("layers", "norm"))
    self.final_norm = ones((D,), ("norm",))
    if not cfg.tie_word_embeddings:
      self.lm_head = normal((D, V), D, ("embed", "vocab"))

  # --- pieces

  def rematerialised(self, layer_fn):
    """layer_fn under the model's remat setting: False = keep every activation, True or "full" =
    keep only the layer inputs, "dots" = keep the projections' outputs and recompute the rest
    (norms, RoPE, softmax, SwiGLU)."""
    if not self.remat:
      return layer_fn
    policies = {True: jax.checkpoint_policies.nothing_saveable, "full": jax.checkpoint_policies.nothing_saveable,
                "dots": jax.checkpoint_policies.save_only_these_names("dense")}
    return jax.checkpoint(layer_fn, policy=policies[self.remat])

  def _layer_params(self) -> dict:
    names = ["wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm", "mlp_norm"]
    if self.cfg.attention_bias:
      names += ["bq", "bk", "bv"]
    return {n: getattr(self, n)[...] for n in names}

  def unembed_rows(self, *, param_dtype: bool = False) -> jax.Array:
    """The unembedding as [V, D] rows in the compute dtype (param_dtype: as stored, for `lm_head`, which
    casts it and sums its gradient in float32): with tied embeddings the embedding itself, else the lm-head
    transposed (make it once outside a loop)."""
    w = self.embed[...] if self.cfg.tie_word_embeddings else self.lm_head[...].T
    return w if param_dtype else w.astype(self.dtype)

  def embed_tokens(self, tokens_NxS: jax.Array) -> jax.Array:
    return jnp.take(self.embed[...], tokens_NxS, axis=0).astype(self.dtype)

  def final_hidden(self, h_NxSxD: jax.Array) -> jax.Array:
    return rms_norm(h_NxSxD, self.final_norm[...], self.cfg.rms_norm_eps)

  # --- forward

  def hidden(self, tokens_NxS: jax.Array, positions_NxS: jax.Array | None = None,
             key_mask_NxS: jax.Array | None = None, segments_NxS: jax.Array | None = None) -> jax.Array:
    """Final-normed hidden states [N, S, D] under a causal mask (no cache).

    Right padding needs no mask: a padded key is never before a valid query.
    `key_mask_NxS` (True = attend) is for layouts with holes; `segments_NxS`
    for sequences laid end to end: a query sees only keys of its own segment.
    """
    N, S = tokens_NxS.shape
    if positions_NxS is None:
      positions_NxS = jnp.broadcast_to(jnp.arange(S), (N, S))
    h = self.embed_tokens(tokens_NxS)
    mask_NxSxS = jnp.tril(jnp.ones((S, S), bool))[None]  # [1, S, S] causal
    if key_mask_NxS is not None:
      mask_NxSxS = mask_NxSxS & key_mask_NxS[:, None, :]
    if segments_NxS is not None:
      mask_NxSxS = mask_NxSxS & (segments_NxS[:, :, None] == segments_NxS[:, None, :])
    cos, sin = rope_tables(positions_NxS, self.cfg)

    def layer(h, p):
      q, k, v = self._qkv(h, p, cos, sin)
      o = attention(q, k, v, mask_NxSxS)
      h = h + dense(o, p["wo"].astype(self.dtype), 2)
      return h + self._mlp(h, p), None

    h, _ = jax.lax.scan(self.rematerialised(layer), h, self._layer_params())
    return self.final_hidden(h)

  def _qkv(self, h, p, cos, sin):
    x = rms_norm(h, p["attn_norm"], self.cfg.rms_norm_eps)
    dt = self.dtype
    q = dense(x, p["wq"].astype(dt), 1)
    k = dense(x, p["wk"].astype(dt), 1)
    v = dense(x, p["wv"].astype(dt), 1)
    if self.cfg.attention_bias:
      q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def _mlp(self, h, p):
    x = rms_norm(h, p["mlp_norm"], self.cfg.rms_norm_eps)
    dt = self.dtype
    g = dense(x, p["w_gate"].astype(dt), 1)
    u = dense(x, p["w_up"].astype(dt), 1)
    return dense(jax.nn.silu(g) * u, p["w_down"].astype(dt), 1)

  def logits(self, h_NxSxD: jax.Array) -> jax.Array:
    """Float32 logits [N, S, V]; only for small S (decode, tests)."""
    return jnp.einsum("nsd,vd->nsv", h_NxSxD, self.unembed_rows(), preferred_element_type=jnp.float32)

  def logits_columns(self, hT_DxN: jax.Array, unembed_VxD: jax.Array | cpu_kernel.Panels | None = None) -> jax.Array:
    """Float32 logits [V, N] of column-major hidden states (`decode_columns`): E [V, D] @ h^T, which XLA's
    CPU matmul runs without repacking E, unlike h @ E^T; or `decode_unembed`'s panels through the kernel."""
    w = self.unembed_rows() if unembed_VxD is None else unembed_VxD
    if isinstance(w, cpu_kernel.Panels):
      return cpu_kernel.matmul(w, hT_DxN)
    return jnp.matmul(w, hT_DxN, preferred_element_type=jnp.float32)

  def decode_unembed(self) -> jax.Array | cpu_kernel.Panels:
    """The unembedding as `logits_columns` reads it in a decode loop: `unembed_rows`, or packed for
    `cpu_kernel` where it applies; make it once outside a loop."""
    if cpu_kernel.usable(self.dtype):
      return cpu_kernel.pack_rows(self.unembed_rows())
    return self.unembed_rows()

  # --- KV cache

  def decode_layers(self) -> list[dict]:
    """Each layer's weights as arrays of their own, as `decode` reads them; make them once outside a loop."""
    return decode_layers(self._layer_params(), self.cfg.num_layers, self.dtype)

  def prefill(self, tokens_NxP: jax.Array, length: int) -> tuple[jax.Array, list[KVCache]]:
    """Runs right-padded prompts; returns hidden [N, P, D] and a cache of `length` >= P slots per row
    holding the prompt's keys and values in slots [0, P)."""
    N, P = tokens_NxP.shape
    positions = jnp.broadcast_to(jnp.arange(P), (N, P))
    h = self.embed_tokens(tokens_NxP)
    causal = jnp.tril(jnp.ones((P, P), bool))[None]
    cos, sin = rope_tables(positions, self.cfg)

    def layer(h, p):
      q, k, v = self._qkv(h, p, cos, sin)
      o = attention(q, k, v, causal)
      h = h + dense(o, p["wo"].astype(self.dtype), 2)
      return h + self._mlp(h, p), KVCache.from_prompt(k, v)

    h, stacked = jax.lax.scan(layer, h, self._layer_params())
    cache = [KVCache(stacked.k[i], stacked.v[i]).with_slots(length - P) for i in range(self.cfg.num_layers)]
    return self.final_hidden(h), cache

  def decode(self, tokens_N: jax.Array, positions_N: jax.Array, slot: jax.Array, attend_NxT: jax.Array,
             cache: list[KVCache] | list[GroupKVCache], layers: list[dict] | None = None) -> tuple[jax.Array, list]:
    """One token per row at RoPE position positions_N[i]; returns hidden [N, D] and the updated cache.

    Each layer first writes the new key and value into cache column `slot`,
    the same column for every row (an in-place column write, no per-row
    scatter), then each row attends to the slots attend_NxT marks, which must
    include `slot`. Pass `layers=self.decode_layers()` made once outside a loop. The cache is a list of
    `KVCache` (every slot per row) or of `GroupKVCache` (prompt slots once per group of rows). The sampler's
    loop stays column-major instead: `decode_columns`, then `logits_columns`.
    """
    hT_DxN, cache = self.decode_columns(tokens_N, positions_N, slot, attend_NxT, cache, layers)
    return hT_DxN.T, cache

  def decode_columns(self, tokens_N, positions_N, slot, attend_NxT, cache: list[KVCache] | list[GroupKVCache],
                     layers: list[dict] | None = None) -> tuple[jax.Array, list]:
    """`decode` with the final-normed hidden states column-major, [D, N] (see model/decode.py)."""
    layers = self.decode_layers() if layers is None else layers
    hT_DxN = self.embed_tokens(tokens_N).T
    cosT, sinT = rope_tables_cols(*rope_tables(positions_N[:, None], self.cfg))
    new_cache = []
    for p, c in zip(layers, cache):
      hT_DxN, c = decode_layer(hT_DxN, p, c, cosT, sinT, slot, attend_NxT, self.cfg)
      new_cache.append(c)
    return rms_norm_cols(hT_DxN, self.final_norm[...], self.cfg.rms_norm_eps), new_cache


# --- functions


def dense(x, w, contract: int):
  """x [..., a1..ac] times w [a1..ac, b...] -> [..., b...] as ONE 2-D matmul.

  Leading dims of x are flattened into one token axis and w's into one input
  axis: XLA's CPU backward of a 3-D einsum transposes its big operands
  element by element; the 2-D form runs as plain matmuls both ways. On the
  CPU bf16 products keep f32 sums, rounded once after the "dense" name the
  "dots" remat policy saves (`cpu_bf16`).
  """
  lead, ins, outs = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:], w.shape[contract:]
  x2, w2 = x.reshape(math.prod(lead), math.prod(ins)), w.reshape(math.prod(ins), math.prod(outs))
  if cpu_bf16.applies(x2, w2):
    y = checkpoint_name(cpu_bf16.matmul_f32_sums(x2, w2), "dense").astype(jnp.bfloat16)
  else:
    y = checkpoint_name(x2 @ w2, "dense")
  return y.reshape(*lead, *outs)


def rms_norm(x, w, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies [Dh/2], with Llama-3 scaling when configured."""
  dh = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  s = cfg.rope_scaling
  if s is None:
    return inv
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
  mid = (1 - smooth) * inv / s.factor + smooth * inv
  is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(is_mid, mid, scaled)


def rope_tables(positions_NxS: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """cos, sin [N, S, 1, Dh] in float32 (half-split layout, as in Hugging Face)."""
  ang = positions_NxS.astype(jnp.float32)[..., None] * rope_frequencies(cfg)
  ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_NxSxHxDh, cos, sin):
  x = x_NxSxHxDh.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_NxSxHxDh.dtype)


def attention(q_NxSxHxDh, k_NxTxKxDh, v_NxTxKxDh, mask_NxSxT):
  """Grouped-query softmax attention; scores and softmax in float32."""
  N, S, H, Dh = q_NxSxHxDh.shape
  K = k_NxTxKxDh.shape[2]
  q = q_NxSxHxDh.reshape(N, S, K, H // K, Dh)
  scores = jnp.einsum("nskgd,ntkd->nkgst", q, k_NxTxKxDh, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(Dh)
  scores = jnp.where(mask_NxSxT[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_NxTxKxDh.dtype)
  o = jnp.einsum("nkgst,ntkd->nskgd", probs, v_NxTxKxDh)
  return o.reshape(N, S, H, Dh)


def init_random(cfg: ModelConfig, *, seed: int = 0, dtype="float32", param_dtype="float32",
                remat: bool = False) -> Transformer:
  return Transformer(cfg, rngs=nnx.Rngs(params=seed), dtype=dtype, param_dtype=param_dtype, remat=remat)


def model_config_from_random_init(r) -> ModelConfig:
  """ModelConfig from a `config_model.RandomInitConfig` section."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**{k: getattr(r, k) for k in fields if hasattr(r, k)})

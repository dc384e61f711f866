"""The column-major decode layer's pieces equal the row-major model's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model import cpu_kernel, decode
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.llama import apply_rope, init_random, rms_norm, rope_tables

CFG = ModelConfig(architecture="qwen2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, attention_bias=True)


def test_column_norm_and_rope_equal_the_row_versions():
  x_NxHxDh = jax.random.normal(jax.random.key(0), (5, 4, 8))
  w = jax.random.normal(jax.random.key(1), (8,))
  cos, sin = rope_tables(jnp.arange(5)[:, None] + 3, CFG)  # [N, 1, 1, Dh]
  norm_rows = rms_norm(x_NxHxDh[:, 0], w, 1e-6)
  np.testing.assert_allclose(decode.rms_norm_cols(x_NxHxDh[:, 0].T, w, 1e-6).T, norm_rows, rtol=1e-6, atol=1e-6)
  rope_rows = apply_rope(x_NxHxDh[:, None], cos, sin)[:, 0]  # [N, H, Dh]
  cosT, sinT = (jnp.transpose(t[:, 0], (1, 2, 0)) for t in (cos, sin))
  rope_cols = decode.rope_cols(jnp.transpose(x_NxHxDh, (1, 2, 0)), cosT, sinT)
  np.testing.assert_allclose(jnp.transpose(rope_cols, (2, 0, 1)), rope_rows, rtol=1e-6, atol=1e-6)


def test_without_the_cpu_kernel_decode_layers_are_each_layers_matrices_transposed_to_out_by_in():
  m = init_random(CFG, seed=0)
  with cpu_kernel.forced(False):
    layers = m.decode_layers()
  assert len(layers) == CFG.num_layers
  p = m._layer_params()
  D, H, K, Dh, F = 32, 4, 2, 8, 48
  for i, layer in enumerate(layers):
    np.testing.assert_array_equal(layer["wq"], p["wq"][i].reshape(D, H * Dh).T)
    np.testing.assert_array_equal(layer["wk"], p["wk"][i].reshape(D, K * Dh).T)
    np.testing.assert_array_equal(layer["wo"], p["wo"][i].reshape(H * Dh, D).T)
    np.testing.assert_array_equal(layer["w_down"], p["w_down"][i].T)
    assert layer["w_gate"].shape == (F, D)
    np.testing.assert_array_equal(layer["bq"], p["bq"][i])  # biases and norms stay as they are
    np.testing.assert_array_equal(layer["attn_norm"], p["attn_norm"][i])


def test_column_logits_equal_the_row_logits_tied_and_untied():
  hT_DxN = jax.random.normal(jax.random.key(2), (32, 5))
  for tied in (True, False):
    m = init_random(dataclasses.replace(CFG, tie_word_embeddings=tied), seed=1)
    rows_NxV = m.logits(hT_DxN.T[:, None])[:, 0]
    np.testing.assert_allclose(m.logits_columns(hT_DxN).T, rows_NxV, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m.logits_columns(hT_DxN, m.unembed_rows()).T, rows_NxV, rtol=1e-5, atol=1e-5)

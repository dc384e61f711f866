"""Chunked log-probs through the lm-head (model/lm_head.py): values, gradients and the chunk rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model import lm_head


def _inputs(M=300, V=512, D=32, seed=0):
  kh, kw, kt = jax.random.split(jax.random.key(seed), 3)
  h = jax.random.normal(kh, (M, D), jnp.float32)
  w = jax.random.normal(kw, (V, D), jnp.float32) * 0.3
  t = jax.random.randint(kt, (M,), 0, V)
  temp = jnp.where(jnp.arange(M) % 3 == 0, 1.0, 0.7)
  return h, w, t, temp


def _full(h, w, t, temp, g_logp, g_ent):
  """The same loss from the whole [M, V] logits at once, autodiffed."""
  z = (h @ w.T) / temp[:, None]
  logp_all = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(logp_all, t[:, None], axis=-1)[:, 0]
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent)


@pytest.mark.parametrize("keep_logits", [True, False], ids=["logits_kept", "logits_recomputed"])
@pytest.mark.parametrize("chunk", [1, 64, 300, 1000])
def test_chunked_log_probs_entropy_and_gradients_equal_the_full_logits(chunk, keep_logits):
  h, w, t, temp = _inputs()
  g_logp, g_ent = (jax.random.normal(k, (h.shape[0],)) for k in jax.random.split(jax.random.key(9)))

  def chunked(h, w):
    logp, ent = lm_head.token_log_probs(h, w, t, chunk=chunk, temperature=temp, with_entropy=True,
                                        keep_logits=keep_logits)
    return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent)

  logp, ent = jax.jit(lambda h, w: lm_head.token_log_probs(h, w, t, chunk=chunk, temperature=temp,
                                                           with_entropy=True))(h, w)
  z = (h @ w.T) / temp[:, None]
  np.testing.assert_allclose(logp, jnp.take_along_axis(jax.nn.log_softmax(z), t[:, None], axis=-1)[:, 0],
                             rtol=1e-5, atol=1e-5)
  p = jax.nn.softmax(z)
  np.testing.assert_allclose(ent, -jnp.sum(p * jnp.log(p), axis=-1), rtol=1e-4, atol=1e-5)
  got = jax.jit(jax.grad(chunked, argnums=(0, 1)))(h, w)
  want = jax.grad(_full, argnums=(0, 1))(h, w, t, temp, g_logp, g_ent)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_without_entropy_the_gradient_is_the_log_probs_alone_and_no_entropy_comes_back():
  h, w, t, temp = _inputs(M=70)
  logp, ent = lm_head.token_log_probs(h, w, t, chunk=16, temperature=temp)
  assert ent is None and logp.shape == (70,)
  g = jax.grad(lambda w: lm_head.token_log_probs(h, w, t, chunk=16, temperature=temp)[0].sum())(w)
  want = jax.grad(_full, argnums=1)(h, w, t, temp, jnp.ones(70), jnp.zeros(70))
  np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)


def test_bf16_weight_gradient_does_not_lose_precision_as_the_chunks_grow():
  """The unembedding's gradient is summed over chunks in float32: with 256 chunks of 16 tokens in bf16 it is
  about as close to the float32 gradient as with one chunk (1.4x; autodiff of the loop summed it in bf16:
  7.5x further off, 1.8% against 0.24%)."""
  M, V, D = 4096, 4096, 64
  h, w, t, _ = _inputs(M, V, D, seed=1)
  w = w * 0.2

  def grad_w(chunk, dtype):
    f = lambda w: lm_head.token_log_probs(h.astype(dtype), w.astype(dtype), t, chunk=chunk)[0].sum()
    return jax.jit(jax.grad(f))(w)

  ref = grad_w(M, jnp.float32)
  err = {c: float(jnp.linalg.norm(grad_w(c, jnp.bfloat16) - ref) / jnp.linalg.norm(ref)) for c in (M, 16)}
  assert err[M] < 5e-3 and err[16] < 2 * err[M], err


def test_the_weight_gradient_comes_back_in_the_weights_dtype_summed_in_float32():
  h, w, t, _ = _inputs(M=40)
  g = jax.grad(lambda w: lm_head.token_log_probs(h.astype(jnp.bfloat16), w, t, chunk=8)[0].sum())(w)
  assert g.dtype == jnp.float32
  g16 = jax.grad(lambda w: lm_head.token_log_probs(h.astype(jnp.bfloat16), w, t, chunk=8)[0].sum())(
      w.astype(jnp.bfloat16))
  assert g16.dtype == jnp.bfloat16


def test_the_backward_reads_the_kept_logits_and_recomputes_them_beyond_the_budget(monkeypatch):
  """Kept logits give the recomputed backward's gradients (to float32 rounding: XLA fuses the two programs'
  elementwise work differently), with one lm-head product fewer in the program; past KEPT_LOGITS_BYTES the
  backward recomputes them."""
  h, w, t, temp = _inputs(M=200)

  def grads(keep_logits):
    f = lambda h, w: lm_head.token_log_probs(h, w, t, chunk=64, temperature=temp, keep_logits=keep_logits)[0]
    loss = lambda h, w: jnp.sum(f(h, w) * jnp.linspace(0.5, 1.5, 200))
    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    dots = g.lower(h, w).as_text().count("dot_general")
    return g(h, w), dots

  (kept, dots_kept), (recomputed, dots_recomputed) = grads(True), grads(False)
  for a, b in zip(kept, recomputed):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert (dots_kept, dots_recomputed) == (3, 4)  # forward; dW and dh (and the recomputed logits)
  assert grads(None)[1] == 3  # 256 x 512 x 4 bytes of logits: within the budget
  monkeypatch.setattr(lm_head, "KEPT_LOGITS_BYTES", 256 * 512 * 4 - 1)
  assert grads(None)[1] == 4


def test_auto_chunk_is_128_tokens_on_a_cpu_and_a_gibibyte_of_logits_on_an_accelerator():
  assert lm_head.chunk_tokens("auto", 151936, backend="cpu") == 128
  assert lm_head.chunk_tokens("auto", 151936, backend="gpu") == 1664  # 1664 x 151936 x 4 B <= 1 GiB
  assert 1664 * 151936 * 4 <= 2**30 < (1664 + 128) * 151936 * 4
  assert lm_head.chunk_tokens("auto", 49152, backend="tpu") == 5376
  assert lm_head.chunk_tokens("auto", 10**8, backend="gpu") == 128  # at least 128
  assert lm_head.chunk_tokens(40, 151936, backend="gpu") == 40


def test_zero_tokens_give_empty_results():
  h, w, _, _ = _inputs(M=1)
  logp, ent = lm_head.token_log_probs(h[:0], w, jnp.zeros((0,), jnp.int32), chunk=16, with_entropy=True)
  assert logp.shape == ent.shape == (0,)

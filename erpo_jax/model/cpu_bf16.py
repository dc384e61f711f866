"""bfloat16 products on the CPU in the one form XLA's CPU runs in its bf16 kernels, forward and backward.

Dimension letters: M rows (tokens), K contracted, N out, V vocab, D hidden, C tokens per lm-head chunk.

XLA's CPU runs bf16 x bf16 -> float32 in its bf16 kernels (YNNPACK: AVX512-BF16, AMX) only when the
left operand contracts its last axis; any other product it converts to float32 first. Autodiff's weight
gradient x^T @ dy contracts the token axis of both operands (and its cotangent arrives in float32), so a
bf16 backward ran at float32's speed or below. The custom VJPs here keep every product of that one form:
x^T is laid out by `rows_transposed`, the cotangent is rounded to bf16 once, sums stay float32.
`llama.dense` names `matmul_f32_sums`' float32 output for the "dots" remat policy before rounding it:
XLA's CPU has no in-place bf16 dynamic-update-slice, so saved bf16 outputs cost it a convert of the
whole saved stack for every layer. GPUs and TPUs never come here (`applies`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def applies(*arrays: jax.Array) -> bool:
  """All bfloat16, on the CPU backend."""
  return all(a.dtype == jnp.bfloat16 for a in arrays) and jax.default_backend() == "cpu"


def rows_transposed(x_MxK: jax.Array) -> jax.Array:
  """x^T [K, M] as a transpose XLA keeps: a plain 2-D transpose feeding a product is folded into the
  product's dimension numbers (the slow form); the same permutation through a 3-D view is not."""
  M, K = x_MxK.shape
  g = next((g for g in (16, 8, 4, 2) if M % g == 0 and M > g), 1)
  if g == 1:
    return x_MxK.T
  return x_MxK.reshape(M // g, g, K).transpose(2, 0, 1).reshape(K, M)


def matmul_rounded(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b; bf16 on the CPU as float32 sums rounded once to bf16 (XLA's CPU runs bf16 -> bf16 products at
  float32's speed or below, bf16 -> float32 in its bf16 kernels). For products with no gradient (decode)."""
  if applies(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  return a @ b


@jax.custom_vjp
def matmul_f32_sums(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """bf16 [M, K] @ bf16 [K, N] -> float32 sums [M, N]; the gradients are bf16, from float32 sums."""
  return jnp.matmul(x_MxK, w_KxN, preferred_element_type=jnp.float32)


def _matmul_fwd(x_MxK, w_KxN):
  return matmul_f32_sums(x_MxK, w_KxN), (x_MxK, w_KxN)


def _matmul_bwd(res, dy_MxN):
  x_MxK, w_KxN = res
  dy_MxN = dy_MxN.astype(jnp.bfloat16)
  dx_MxK = jax.lax.dot_general(dy_MxN, w_KxN, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  dw_KxN = jnp.matmul(rows_transposed(x_MxK), dy_MxN, preferred_element_type=jnp.float32)
  return dx_MxK.astype(jnp.bfloat16), dw_KxN.astype(w_KxN.dtype)


matmul_f32_sums.defvjp(_matmul_fwd, _matmul_bwd)


def _cpu(cpu_form: bool | None, *arrays: jax.Array) -> bool:
  """The CPU's bf16 product form: as asked, or (None) where `applies`."""
  return applies(*arrays) if cpu_form is None else cpu_form


def lm_head_logits(w_VxD: jax.Array, h_CxD: jax.Array, *, cpu_form: bool | None = None) -> jax.Array:
  """Float32 logits [V, C] = W [V, D] @ h^T, h^T laid out by `rows_transposed` in the CPU's bf16 form
  (cpu_form: None = where `applies`)."""
  if _cpu(cpu_form, w_VxD, h_CxD):
    return jnp.matmul(w_VxD, rows_transposed(h_CxD), preferred_element_type=jnp.float32)
  return jnp.matmul(w_VxD, h_CxD.T, preferred_element_type=jnp.float32)


def lm_head_grads(w_VxD: jax.Array, h_CxD: jax.Array, g_VxC: jax.Array, *, cpu_form: bool | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """The gradients of `lm_head_logits` for the logits' cotangent g [V, C] (in the compute dtype): float32
  sums dW [V, D] = g @ h and dh [C, D] = g^T @ W, g^T laid out by `rows_transposed` in the CPU's bf16 form."""
  dw_VxD = jnp.matmul(g_VxC, h_CxD, preferred_element_type=jnp.float32)
  g_CxV = rows_transposed(g_VxC) if _cpu(cpu_form, w_VxD, h_CxD, g_VxC) else g_VxC.T
  return dw_VxD, jnp.matmul(g_CxV, w_VxD, preferred_element_type=jnp.float32)

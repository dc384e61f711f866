"""The update's group attention: the CPU kernel's output and every gradient equal XLA's ops on the same inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_builds
from erpo_jax.model import cpu_kernel
from erpo_jax.model.group_attention import group_attention, xla_group_attention


@pytest.fixture(scope="module")
def kernel():
  with cpu_kernel.forced(True):
    if not cpu_kernel.usable(jnp.float32):
      pytest.skip(f"the CPU kernel is {cpu_kernel.status()}")


CASES = {  # B, G, R, P, H, K, Dh, prompt_len_B
    "reference-shape": (4, 8, 64, 64, 9, 3, 64, [50, 53, 48, 51]),
    "empty-and-full-prompts": (2, 2, 9, 16, 6, 2, 34, [0, 16]),
    "head-dim-below-a-vector": (2, 3, 5, 7, 4, 2, 6, [3, 7]),
    "one-row-per-prompt": (3, 1, 6, 5, 2, 1, 16, [5, 1, 4]),
    "response-longer-than-prompt": (1, 4, 37, 3, 3, 3, 8, [2]),
}


def _case(seed, B, G, R, P, H, K, Dh, prompt_len_B):
  ks = jax.random.split(jax.random.key(seed), 6)
  N = B * G
  args = (jax.random.normal(ks[0], (N, R, H, Dh)), jax.random.normal(ks[1], (B, P, K, Dh)),
          jax.random.normal(ks[2], (B, P, K, Dh)), jax.random.normal(ks[3], (N, R, K, Dh)),
          jax.random.normal(ks[4], (N, R, K, Dh)))
  return args, jnp.asarray(prompt_len_B, jnp.int32), jax.random.normal(ks[5], (N, R, H, Dh))


def _value_and_grads(attention, args, prompt_len_B, cotangent):
  loss = lambda *a: jnp.sum(attention(*a, prompt_len_B) * cotangent)
  return jax.jit(jax.value_and_grad(loss, argnums=range(5)))(*args)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_attention_and_its_gradients_equal_xla_ops(kernel, case):
  args, len_B, ct = _case(1, *case)
  G = case[1]
  want = jax.jit(lambda *a: xla_group_attention(*a, len_B, G))(*args)
  got = jax.jit(lambda *a: group_attention(*a, len_B, G, kernel=True))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
  loss_x, grads_x = _value_and_grads(lambda *a: xla_group_attention(*a, G), args, len_B, ct)
  loss_k, grads_k = _value_and_grads(lambda *a: group_attention(*a, G, kernel=True), args, len_B, ct)
  np.testing.assert_allclose(float(loss_k), float(loss_x), rtol=2e-5)
  for name, gk, gx in zip(["q", "prompt k", "prompt v", "response k", "response v"], grads_k, grads_x):
    np.testing.assert_allclose(np.asarray(gk), np.asarray(gx), rtol=1e-4, atol=2e-5, err_msg=name)
  # Prompt slots past a prompt's length get no gradient.
  for b, n in enumerate(case[-1]):
    assert not np.any(np.asarray(grads_k[1])[b, n:]) and not np.any(np.asarray(grads_k[2])[b, n:])


def test_the_default_takes_the_kernel_only_where_it_is_usable(kernel):
  args, len_B, _ = _case(2, *CASES["head-dim-below-a-vector"])
  for on in (True, False):
    with cpu_kernel.forced(on):
      hlo = jax.jit(lambda *a: group_attention(*a, len_B, 3)).lower(*args).as_text()
    assert (cpu_kernel.TRAIN_ATTENTION_TARGETS[0] in hlo) == on


def test_kernel_attention_rejects_rows_that_are_not_whole_groups(kernel):
  args, len_B, _ = _case(3, *CASES["head-dim-below-a-vector"])
  q = args[0][:5]  # 5 rows for 2 prompts
  with pytest.raises(Exception, match="erpo_group_attention_fwd_v1"):
    jax.block_until_ready(jax.ffi.ffi_call(cpu_kernel.TRAIN_ATTENTION_TARGETS[0], (
        jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)))(
            q, *args[1:], len_B))


def test_the_avx2_build_of_the_kernel_attention_equals_xla_ops_too(kernel, tmp_path):
  """Machines without AVX-512 build 8-lane vectors; this CPU runs that build too."""
  lib = kernel_builds.avx2_build(tmp_path)
  fwd, bwd = "erpo_group_attention_fwd_avx2_test", "erpo_group_attention_bwd_avx2_test"
  cpu_kernel.register_train_attention(lib, (fwd, bwd))
  for case in CASES.values():
    args, len_B, ct = _case(4, *case)
    f32 = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)
    o, lse = jax.ffi.ffi_call(fwd, (f32(args[0]), jax.ShapeDtypeStruct(args[0].shape[:3], jnp.float32)))(
        *args, len_B)
    grads = jax.ffi.ffi_call(bwd, tuple(f32(x) for x in args))(*args, len_B, o, lse, ct)
    want, vjp = jax.vjp(lambda *a: xla_group_attention(*a, len_B, case[1]), *args)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=2e-5, atol=2e-5)
    for gk, gx in zip(grads, vjp(ct)):
      np.testing.assert_allclose(np.asarray(gk), np.asarray(gx), rtol=1e-4, atol=2e-5)



def test_kernel_attention_vmapped_over_streams_equals_each_stream_alone(kernel):
  """Packing with several streams maps the layer over them (`shared_prefix`): the kernel runs once per stream."""
  case = CASES["empty-and-full-prompts"]
  (a, len_B, _), (b, _, _) = _case(5, *case), _case(6, *case)
  attention = lambda *x: group_attention(*x, len_B, case[1], kernel=True)
  got = jax.jit(jax.vmap(attention))(*(jnp.stack(pair) for pair in zip(a, b)))
  for i, args in enumerate((a, b)):
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(attention(*args)), rtol=1e-6, atol=1e-6)

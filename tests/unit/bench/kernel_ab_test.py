"""scripts/kernel_ab.py: another checkout's kernel library runs the update attention under target names of its own."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.model import cpu_kernel
from erpo_jax.model.group_attention import group_attention

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _script():
  spec = importlib.util.spec_from_file_location("kernel_ab", ROOT / "scripts" / "kernel_ab.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_a_folder_without_the_kernel_source_is_one_clear_error(tmp_path):
  with pytest.raises(SystemExit, match=r"--other .*: no erpo_jax/model/cpu_decode.cc there"):
    _script().register_other(str(tmp_path))


def test_the_other_build_answers_under_its_own_names_with_the_same_values(tmp_path):
  with cpu_kernel.forced(True):
    if not cpu_kernel.usable(jnp.float32):
      pytest.skip(f"the CPU kernel is {cpu_kernel.status()}")
    ab = _script()
    ab.register_other(str(ROOT), str(tmp_path))  # this checkout's source, built again: the same sums
    ks = jax.random.split(jax.random.key(0), 6)
    B, G, R, P, H, K, Dh = 2, 3, 7, 9, 4, 2, 16
    args = (jax.random.normal(ks[0], (B * G, R, H, Dh)), jax.random.normal(ks[1], (B, P, K, Dh)),
            jax.random.normal(ks[2], (B, P, K, Dh)), jax.random.normal(ks[3], (B * G, R, K, Dh)),
            jax.random.normal(ks[4], (B * G, R, K, Dh)))
    prompt_len_B, cotangent = jnp.asarray([4, 9], jnp.int32), jax.random.normal(ks[5], (B * G, R, H, Dh))

    def value_and_grads():
      loss = lambda *a: jnp.sum(group_attention(*a, prompt_len_B, G, kernel=True) * cotangent)
      fn = jax.jit(jax.value_and_grad(loss, argnums=range(5)))
      return fn.lower(*args).as_text(), fn(*args)

    text, ours = value_and_grads()
    with cpu_kernel.train_attention_targets(ab.OTHER_TARGETS):
      other_text, other = value_and_grads()
  assert ab.OTHER_TARGETS[0] in other_text and ab.OTHER_TARGETS[1] in other_text
  assert ab.OTHER_TARGETS[0] not in text and cpu_kernel.TRAIN_ATTENTION_TARGETS[0] in text
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(other)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

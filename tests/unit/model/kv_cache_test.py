"""The decode cache: keys slot-last, values slot-major, and one-query attention over them."""

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model.kv_cache import KVCache, decode_attention
from erpo_jax.model.llama import attention

N, T, H, K, Dh = 3, 7, 6, 2, 8


def _qkv(seed):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (N, H, Dh)), jax.random.normal(kk, (N, T, K, Dh)),
          jax.random.normal(kv, (N, T, K, Dh)))


def test_decode_attention_over_the_cache_equals_full_attention_of_one_query():
  q, k, v = _qkv(0)
  attend = jnp.arange(T)[None] < jnp.array([2, 5, 7])[:, None]  # each row sees its own number of slots
  cache = KVCache.from_prompt(k, v)
  assert cache.k.shape == (N, K, Dh, T) and cache.v.shape == (N, K, T, Dh)
  got = decode_attention(q, cache.k, cache.v, attend)
  want = attention(q[:, None], k, v, attend[:, None, :])[:, 0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_write_fills_one_slot_of_every_row_and_nothing_else():
  q, k, v = _qkv(1)
  cache = KVCache.from_prompt(k[:, :4], v[:, :4]).with_slots(3)
  assert cache.k.shape == (N, K, Dh, 7) and float(jnp.abs(cache.k[..., 4:]).max()) == 0.0
  cache = cache.write(k[:, 5:6], v[:, 5:6], jnp.int32(5))
  np.testing.assert_array_equal(cache.k[..., 5], k[:, 5])
  np.testing.assert_array_equal(cache.v[:, :, 5], v[:, 5])
  np.testing.assert_array_equal(cache.k[..., :4], jnp.transpose(k[:, :4], (0, 2, 3, 1)))
  assert float(jnp.abs(cache.k[..., 4]).max()) == 0.0 and float(jnp.abs(cache.v[:, :, 6]).max()) == 0.0

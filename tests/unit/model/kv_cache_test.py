"""The decode cache: keys slot-last, values slot-major, and one-query attention over them; the grouped form
holds a prompt's slots once for its G rows and attends exactly as the per-row cache does."""

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.model.kv_cache import GroupKVCache, KVCache, decode_attention
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


def _group_case(seed, B=2, G=3, P=5, M=4):
  """B prompts' P-slot caches, their rows' M response keys and values, queries for N = B*G rows, and each
  row's mask: its prompt's first len_b slots and response slots up to t (rows of a group differ in t)."""
  ks = jax.random.split(jax.random.key(seed), 5)
  N = B * G
  pk, pv = jax.random.normal(ks[0], (B, P, K, Dh)), jax.random.normal(ks[1], (B, P, K, Dh))
  rk, rv = jax.random.normal(ks[2], (N, M, K, Dh)), jax.random.normal(ks[3], (N, M, K, Dh))
  q = jax.random.normal(ks[4], (N, H, Dh))
  len_N = jnp.repeat(jnp.array([3, 5]), G)
  t_N = jnp.arange(N) % M
  slot = jnp.arange(P + M)[None]
  attend = (slot < len_N[:, None]) | ((slot >= P) & (slot <= P + t_N[:, None]))
  return pk, pv, rk, rv, q, attend


def test_group_cache_attention_equals_the_per_row_cache_with_the_prompt_repeated():
  B, G, P, M = 2, 3, 5, 4
  pk, pv, rk, rv, q, attend = _group_case(2, B, G, P, M)
  group = GroupKVCache(KVCache.from_prompt(pk, pv), KVCache.from_prompt(rk, rv))
  full_k = jnp.concatenate([jnp.repeat(pk, G, axis=0), rk], axis=1)  # [N, P + M, K, Dh]
  full_v = jnp.concatenate([jnp.repeat(pv, G, axis=0), rv], axis=1)
  want = KVCache.from_prompt(full_k, full_v).attend(q, attend)
  np.testing.assert_allclose(group.attend(q, attend), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(want, attention(q[:, None], full_k, full_v, attend[:, None, :])[:, 0], atol=1e-5,
                             rtol=1e-5)


def test_group_cache_holds_the_prompt_once_and_writes_only_response_slots():
  B, G, P, M = 2, 3, 5, 4
  pk, pv, rk, rv, q, _ = _group_case(3, B, G, P, M)
  prompt = KVCache.from_prompt(pk, pv)
  cache = GroupKVCache.for_groups(prompt, G, M)
  assert cache.prompt.k.shape == (B, K, Dh, P) and cache.response.k.shape == (B * G, K, Dh, M)
  assert cache.response.v.shape == (B * G, K, M, Dh) and float(jnp.abs(cache.response.k).max()) == 0.0
  cache = cache.write(rk[:, 2:3], rv[:, 2:3], jnp.int32(P + 2))  # slot P + 2 = response slot 2
  np.testing.assert_array_equal(cache.response.k[..., 2], rk[:, 2])
  np.testing.assert_array_equal(cache.response.v[:, :, 2], rv[:, 2])
  np.testing.assert_array_equal(cache.prompt.k, prompt.k)
  np.testing.assert_array_equal(cache.prompt.v, prompt.v)
  others = jnp.concatenate([cache.response.k[..., :2], cache.response.k[..., 3:]], axis=-1)
  assert float(jnp.abs(others).max()) == 0.0

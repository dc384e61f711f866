"""Tests of group-relative advantages and question weights (erpo_jax.algo.advantages)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.algo import advantages as adv


def _np_group_advantages(r, G, eps, scale):
  """Independent float64 reference: loops over contiguous groups."""
  r = np.asarray(r, np.float64)
  out = np.zeros_like(r)
  batch_std = r.std(ddof=1) if r.size > 1 else 0.0
  for start in range(0, r.size, G):
    g = r[start:start + G]
    if G == 1:
      continue
    den = {"group": g.std(ddof=1) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
    out[start:start + G] = (g - g.mean()) / den
  return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_numpy_and_have_zero_mean_per_group(scale):
  rng = np.random.default_rng(0)
  for G in (2, 4, 8):
    r = rng.normal(size=6 * G).astype(np.float32)
    r[:G] = 1.0  # an all-equal group: std 0 -> A = 0, not NaN
    got = np.asarray(adv.group_advantages(r, G, eps=1e-6, scale=scale))
    np.testing.assert_allclose(got, _np_group_advantages(r, G, 1e-6, scale), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.reshape(-1, G).mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_array_equal(got[:G], 0.0)


def test_binary_rewards_hand_checked():
  # Group [1, 0, 0, 0]: mean 0.25, unbiased std = sqrt(0.75/3) = 0.5 -> A = [1.5, -0.5, -0.5, -0.5].
  got = adv.group_advantages(jnp.array([1, 0, 0, 0, 1, 1, 0, 0]), 4, eps=0.0)
  # Group [1, 1, 0, 0]: mean 0.5, std = sqrt(1/3) -> A = +-0.5 * sqrt(3).
  h = 0.5 * np.sqrt(3)
  np.testing.assert_allclose(got, [1.5, -0.5, -0.5, -0.5, h, h, -h, -h], rtol=1e-6)


def test_group_of_size_one_gets_zero():
  for scale in ("group", "batch", "none"):
    np.testing.assert_array_equal(adv.group_advantages(jnp.array([1.0, 0.0, 1.0]), 1, scale=scale), 0.0)


def test_rows_must_split_into_whole_groups():
  with pytest.raises(ValueError, match="groups of 4"):
    adv.group_advantages(jnp.zeros(6), 4)


def test_explicit_group_ids_match_contiguous_layout_after_shuffling():
  rng = np.random.default_rng(1)
  r = rng.integers(0, 2, 24).astype(np.float32)
  want = np.asarray(adv.group_advantages(r, 4))
  perm = rng.permutation(24)
  got = adv.group_advantages_by_id(r[perm], perm // 4, 6)
  np.testing.assert_allclose(got, want[perm], rtol=1e-6)


def test_invalid_rows_are_left_out_of_group_statistics():
  # Group 0 = rows 0..2 with row 2 padding: stats of [1, 0] only -> A = +-0.5 / std([1,0]) = +-0.7071.
  r = jnp.array([1.0, 0.0, 123.0, 1.0, 0.0, 0.0])
  gid = jnp.array([0, 0, 0, 1, 1, 1])
  valid = jnp.array([True, True, False, True, True, True])
  got = adv.group_advantages_by_id(r, gid, 2, valid_N=valid, eps=0.0)
  want_g1 = _np_group_advantages([1.0, 0.0, 0.0], 3, 0.0, "group")
  np.testing.assert_allclose(got, [np.sqrt(0.5), -np.sqrt(0.5), 0.0, *want_g1], rtol=1e-6)


def test_advantages_carry_no_gradient():
  g = jax.grad(lambda r: (adv.group_advantages(r, 2) ** 2).sum())(jnp.array([1.0, 0.0, 0.3, 0.7]))
  np.testing.assert_array_equal(g, 0.0)


def test_zero_std_group_fraction():
  assert float(adv.zero_std_group_fraction(jnp.array([1, 1, 0, 1, 0, 0]), 2)) == pytest.approx(2 / 3)


def test_static_weights_reproduce_spec_example():
  # s = 2, 6, s_bar = 4: w = clip(4/2) = 2, clip(4/6) = 2/3.
  np.testing.assert_allclose(adv.static_weights(np.array([2.0, 6.0])), [2.0, 2 / 3], rtol=1e-6)


def test_static_weights_clip_and_guard_non_positive_nll():
  # s_bar = (0 + 1 + 11) / 3 = 4: s = 0 is floored at 1e-8 -> huge -> hi; 4/1 = 4 -> hi; 4/11 stays.
  np.testing.assert_allclose(adv.static_weights(np.array([0.0, 1.0, 11.0])), [2.0, 2.0, 4 / 11], rtol=1e-6)
  np.testing.assert_allclose(adv.static_weights(np.array([1.0, 7.0]), lo=0.8, hi=1.5), [1.5, 0.8])
  assert np.all(np.isfinite(adv.static_weights(np.array([-1.0, 5.0]))))


def test_dynamic_weights_reproduce_public_implementation_example():
  # NLL [2, 4] with global mean 5: w = 5/2, 5/4.
  np.testing.assert_allclose(adv.dynamic_weights(jnp.array([2.0, 4.0]), jnp.array([True, True]),
                                                 global_mean=jnp.float32(5.0)), [2.5, 1.25])


def test_dynamic_weights_use_batch_mean_clip_and_give_one_to_rows_without_prompt():
  nll = jnp.array([2.0, 4.0, 0.0])
  valid = jnp.array([True, True, False])
  np.testing.assert_allclose(adv.dynamic_weights(nll, valid), [1.5, 0.75, 1.0])  # mean 3
  np.testing.assert_allclose(adv.dynamic_weights(nll, valid, clip=(0.8, 1.2)), [1.2, 0.8, 1.0])


def test_dynamic_weights_are_the_same_whole_or_in_minibatches():
  rng = np.random.default_rng(2)
  nll = jnp.asarray(rng.uniform(0.5, 30.0, 16), jnp.float32)
  valid = jnp.asarray(rng.random(16) > 0.2)
  whole = adv.dynamic_weights(nll, valid)
  pieces = [adv.nll_sum_count(nll[i:i + 4], valid[i:i + 4]) for i in range(0, 16, 4)]
  global_mean = sum(p[0] for p in pieces) / sum(p[1] for p in pieces)
  split = jnp.concatenate([adv.dynamic_weights(nll[i:i + 4], valid[i:i + 4], global_mean=global_mean)
                           for i in range(0, 16, 4)])
  np.testing.assert_allclose(split, whole, rtol=1e-6)


def test_dynamic_weights_carry_no_gradient():
  g = jax.grad(lambda s: adv.dynamic_weights(s, jnp.ones(3, bool)).sum())(jnp.array([1.0, 2.0, 3.0]))
  np.testing.assert_array_equal(g, 0.0)


def test_prompt_nll_sums_scored_prompt_positions():
  logp = jnp.array([[-9.0, -1.0, -2.0, -5.0], [-9.0, -3.0, -7.0, -7.0], [-9.0, -1.0, -1.0, -1.0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
  nll, valid = adv.prompt_nll(logp, mask)  # column 0 never counts
  np.testing.assert_allclose(nll, [3.0, 3.0, 0.0])
  np.testing.assert_array_equal(valid, [True, True, False])


def test_weights_and_advantages_under_jit():
  r = jnp.array([1.0, 0.0, 0.0, 1.0])
  jitted = jax.jit(adv.group_advantages, static_argnames=("group_size", "scale"))
  np.testing.assert_allclose(jitted(r, 2, scale="batch"), adv.group_advantages(r, 2, scale="batch"), rtol=1e-6)
  nll, valid = jnp.array([2.0, 4.0]), jnp.array([True, True])
  np.testing.assert_allclose(jax.jit(adv.dynamic_weights)(nll, valid), [1.5, 0.75])

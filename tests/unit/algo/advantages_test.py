"""Tests of group-relative advantages (erpo_jax.algo.advantages)."""

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


def test_advantages_under_jit_match_eager():
  r = jnp.array([1.0, 0.0, 0.0, 1.0])
  jitted = jax.jit(adv.group_advantages, static_argnames=("group_size", "scale"))
  np.testing.assert_allclose(jitted(r, 2, scale="batch"), adv.group_advantages(r, 2, scale="batch"), rtol=1e-6)


# The worked example of docs/SPEC.md section 3: two groups of G = 4 rewards.
SPEC_REWARDS = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])


def test_rloo_advantages_of_the_spec_example():
  # g1: 1 - (0+0+0)/3 = 1, 0 - (1+0+0)/3 = -1/3.  g2: 1 - (1+0+1)/3 = 1/3, 0 - (1+1+1)/3 = -1.
  got = adv.group_advantages(SPEC_REWARDS, 4, estimator="rloo")
  np.testing.assert_allclose(got, [1, -1 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -1, 1 / 3], rtol=1e-6)


def test_reinforce_advantages_of_the_spec_example_equal_grpo_without_scaling():
  # g1: mean 0.25 -> [0.75, -0.25, -0.25, -0.25].  g2: mean 0.75 -> [0.25, 0.25, -0.75, 0.25].
  got = adv.group_advantages(SPEC_REWARDS, 4, estimator="reinforce")
  np.testing.assert_allclose(got, [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25], rtol=1e-6)
  np.testing.assert_allclose(got, adv.group_advantages(SPEC_REWARDS, 4, scale="none"), rtol=1e-6)


def test_grpo_advantages_of_the_spec_example():
  # g1: std (ddof 1) = sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5]; g2 the mirror image.
  got = adv.group_advantages(SPEC_REWARDS, 4, estimator="grpo", eps=0.0)
  np.testing.assert_allclose(got, [1.5, -0.5, -0.5, -0.5, 0.5, 0.5, -1.5, 0.5], rtol=1e-6)


def test_rloo_is_the_scaled_centred_reward_and_sums_to_zero_per_group():
  r = np.random.default_rng(2).normal(size=24).astype(np.float32)
  got = np.asarray(adv.group_advantages(r, 6, estimator="rloo")).reshape(4, 6)
  r_BxG = r.reshape(4, 6)
  np.testing.assert_allclose(got, 6 / 5 * (r_BxG - r_BxG.mean(axis=1, keepdims=True)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got.sum(axis=1), 0.0, atol=1e-5)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce"])
def test_padding_rows_and_single_row_groups_get_zero(estimator):
  # Group 0: rows [1, 0, 0] valid, row 3 padding (G_v = 3). Group 1: one valid row -> all 0.
  r = jnp.array([1.0, 0.0, 0.0, 99.0, 1.0, 5.0, 5.0, 5.0])
  valid = jnp.array([True, True, True, False, True, False, False, False])
  got = adv.group_advantages(r, 4, estimator=estimator, valid_N=valid)
  # rloo: 1 - 0 = 1, 0 - 1/2 = -0.5.  reinforce: mean 1/3 -> 2/3, -1/3.
  g0 = [1.0, -0.5, -0.5] if estimator == "rloo" else [2 / 3, -1 / 3, -1 / 3]
  np.testing.assert_allclose(got, [*g0, 0, 0, 0, 0, 0], rtol=1e-6)
  np.testing.assert_array_equal(adv.group_advantages(jnp.array([1.0, 0.0]), 1, estimator=estimator), 0.0)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce"])
def test_other_estimators_carry_no_gradient_and_refuse_a_scale(estimator):
  g = jax.grad(lambda r: (adv.group_advantages(r, 2, estimator=estimator) ** 2).sum())(jnp.array([1.0, 0.0, 0.3, 0.7]))
  np.testing.assert_array_equal(g, 0.0)
  with pytest.raises(ValueError, match="grpo estimator only"):
    adv.group_advantages(jnp.zeros(4), 2, estimator=estimator, scale="none")


@pytest.mark.parametrize("estimator,scale", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"),
                                             ("rloo", "group"), ("reinforce", "group")])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(estimator, scale):
  # 8 rewards of 0.1 do not sum to exactly 0.8 in float32: the centred rewards were about 1e-8, and the group
  # scale divided them by a std of the same size (grpo gave -0.0074 to every row of the group).
  for r in (0.1, 0.3, 1 / 3, -0.45, 2.2):
    rewards = jnp.asarray([r] * 8 + [0, 1, 0, 1, 0, 1, 1, 1], jnp.float32)
    a = np.asarray(adv.group_advantages(rewards, 8, estimator=estimator, scale=scale))
    assert np.all(a[:8] == 0.0), (r, a[:8])
    assert np.all(a[8:] != 0.0)
  ids = jnp.asarray([0, 0, 0, 1, 1, 1])
  a = adv.advantages_by_id(jnp.asarray([0.1, 0.1, 5.0, 0.2, 0.7, 0.2], jnp.float32), ids, 2,
                                  estimator=estimator, scale=scale,
                                  valid_N=jnp.asarray([True, True, False, True, True, True]))
  assert np.all(np.asarray(a)[:3] == 0.0)  # equal over its valid rows; the padding row's reward counts nowhere
  assert np.all(np.asarray(a)[3:] != 0.0)

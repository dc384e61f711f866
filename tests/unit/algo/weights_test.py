"""Question weights: the SPEC's static example, the public implementation's dynamic example, and their properties."""

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax.algo import weights


def test_static_weights_reproduce_spec_example():
  # s = 2, 6, s_bar = 4: w = clip(4/2) = 2, clip(4/6) = 2/3.
  np.testing.assert_allclose(weights.static_weights(np.array([2.0, 6.0])), [2.0, 2 / 3], rtol=1e-6)


def test_static_weights_clip_and_guard_non_positive_nll():
  # s_bar = (0 + 1 + 11) / 3 = 4: s = 0 is floored at 1e-8 -> huge -> hi; 4/1 = 4 -> hi; 4/11 stays.
  np.testing.assert_allclose(weights.static_weights(np.array([0.0, 1.0, 11.0])), [2.0, 2.0, 4 / 11], rtol=1e-6)
  np.testing.assert_allclose(weights.static_weights(np.array([1.0, 7.0]), lo=0.8, hi=1.5), [1.5, 0.8])
  assert np.all(np.isfinite(weights.static_weights(np.array([-1.0, 5.0]))))


def test_dynamic_weights_reproduce_public_implementation_example():
  # NLL [2, 4] with global mean 5: w = 5/2, 5/4.
  np.testing.assert_allclose(weights.dynamic_weights(jnp.array([2.0, 4.0]), jnp.array([True, True]),
                                                 global_mean=jnp.float32(5.0)), [2.5, 1.25])


def test_dynamic_weights_use_batch_mean_clip_and_give_one_to_rows_without_prompt():
  nll = jnp.array([2.0, 4.0, 0.0])
  valid = jnp.array([True, True, False])
  np.testing.assert_allclose(weights.dynamic_weights(nll, valid), [1.5, 0.75, 1.0])  # mean 3
  np.testing.assert_allclose(weights.dynamic_weights(nll, valid, clip=(0.8, 1.2)), [1.2, 0.8, 1.0])


def test_dynamic_weights_are_the_same_whole_or_in_minibatches():
  rng = np.random.default_rng(2)
  nll = jnp.asarray(rng.uniform(0.5, 30.0, 16), jnp.float32)
  valid = jnp.asarray(rng.random(16) > 0.2)
  whole = weights.dynamic_weights(nll, valid)
  pieces = [weights.nll_sum_count(nll[i:i + 4], valid[i:i + 4]) for i in range(0, 16, 4)]
  global_mean = sum(p[0] for p in pieces) / sum(p[1] for p in pieces)
  split = jnp.concatenate([weights.dynamic_weights(nll[i:i + 4], valid[i:i + 4], global_mean=global_mean)
                           for i in range(0, 16, 4)])
  np.testing.assert_allclose(split, whole, rtol=1e-6)


def test_dynamic_weights_carry_no_gradient():
  g = jax.grad(lambda s: weights.dynamic_weights(s, jnp.ones(3, bool)).sum())(jnp.array([1.0, 2.0, 3.0]))
  np.testing.assert_array_equal(g, 0.0)


def test_prompt_nll_sums_scored_prompt_positions():
  logp = jnp.array([[-9.0, -1.0, -2.0, -5.0], [-9.0, -3.0, -7.0, -7.0], [-9.0, -1.0, -1.0, -1.0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
  nll, valid = weights.prompt_nll(logp, mask)  # column 0 never counts
  np.testing.assert_allclose(nll, [3.0, 3.0, 0.0])
  np.testing.assert_array_equal(valid, [True, True, False])


def test_dynamic_weights_under_jit_match_eager():
  nll, valid = jnp.array([2.0, 4.0]), jnp.array([True, True])
  np.testing.assert_allclose(jax.jit(weights.dynamic_weights)(nll, valid), [1.5, 0.75])

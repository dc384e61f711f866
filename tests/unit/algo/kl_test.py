"""Tests of the KL estimators and the masked per-row penalty (erpo_jax.algo.kl)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.algo import kl

# SPEC worked example: column 0 is the first prompt token (no log-prob), column 1 the valid position.
LOGP = np.array([[0.0, -1.8], [0.0, -6.3]], np.float32)
REF = np.array([[0.0, -2.0], [0.0, -6.0]], np.float32)
MASK = np.ones((2, 2), bool)


def test_query_kl_reproduces_spec_worked_example():
  # d = 0.2, -0.3: e^-0.2 + 0.2 - 1 = 0.018731, e^0.3 - 0.3 - 1 = 0.049859
  out = kl.row_kl(LOGP, REF, MASK)
  np.testing.assert_allclose(out.per_row_N, [0.01873075307798, 0.04985880757600], atol=1e-6)
  np.testing.assert_allclose(out.per_row_N.mean(), 0.034295, atol=1e-6)
  np.testing.assert_array_equal(out.count_N, [1.0, 1.0])
  assert float(out.clamped) == 0.0


def test_penalty_gradient_is_one_minus_exp_minus_d_over_count():
  rng = np.random.default_rng(0)
  logp = rng.normal(-3, 1, (3, 6)).astype(np.float32)
  ref = logp + rng.normal(0, 0.5, (3, 6)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], bool)
  grad = jax.grad(lambda lp: kl.row_kl(lp, ref, mask).per_row_N.sum())(logp)
  scored = mask.copy()
  scored[:, 0] = False
  d = logp.astype(np.float64) - ref
  want = np.where(scored, (1 - np.exp(-d)) / scored.sum(1, keepdims=True), 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def test_worked_example_gradient_lowers_q1_and_raises_q2():
  grad = jax.grad(lambda lp: kl.row_kl(lp, REF, MASK).per_row_N.sum())(LOGP)
  np.testing.assert_allclose(grad[:, 1], [1 - math.exp(-0.2), 1 - math.exp(0.3)], rtol=1e-5)
  assert grad[0, 1] > 0 > grad[1, 1]


def test_no_gradient_reaches_the_reference():
  grad = jax.grad(lambda ref: kl.row_kl(LOGP, ref, MASK).per_row_N.sum())(REF)
  np.testing.assert_array_equal(grad, np.zeros_like(REF))


def test_k3_is_zero_at_equal_policies():
  logp = np.random.default_rng(1).normal(-2, 1, (4, 5)).astype(np.float32)
  out = kl.row_kl(logp, logp, np.ones((4, 5), bool))
  np.testing.assert_array_equal(out.per_row_N, np.zeros(4))
  assert float(kl.k3_from_log_ratio(jnp.float32(0.0))) == 0.0


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.floats(-30.0, 30.0, allow_nan=False, width=32))
def test_k3_is_nonnegative(d):
  assert float(kl.k3_from_log_ratio(jnp.float32(d))) >= 0.0


def test_k3_is_nonnegative_on_random_arrays():
  d = np.random.default_rng(2).normal(0, 3, 10_000).astype(np.float32)
  d[:100] = np.float32(10.0) ** -np.arange(100, dtype=np.float32) / 10  # values down to underflow
  assert np.all(np.asarray(kl.k3_from_log_ratio(d)) >= 0.0)


def test_k3_keeps_precision_near_zero():
  # k3(d) = d^2/2 - d^3/6 + ...; at d = 1e-8 that is 5e-17, which exp(-d) + d - 1 loses entirely.
  with jax.enable_x64(True):
    d = jnp.float64(1e-8)
    np.testing.assert_allclose(float(kl.k3_from_log_ratio(d)), 5e-17, rtol=1e-6)
    assert float(jnp.exp(-d) + d - 1) <= 0.0  # the naive formula, for contrast
  # float32 at d = 1e-3: expm1 keeps ~4 digits of 5e-7, the naive formula is off by ~10%.
  d32 = np.float32(1e-3)
  exact = 1e-3**2 / 2 - 1e-3**3 / 6
  assert abs(float(kl.k3_from_log_ratio(jnp.float32(d32))) - exact) / exact < 1e-3


def test_k1_and_k2_estimators():
  d = jnp.array([-0.3, 0.0, 0.2], jnp.float32)
  np.testing.assert_allclose(kl.kl_estimate(d, "k1"), [-0.3, 0.0, 0.2])
  np.testing.assert_allclose(kl.kl_estimate(d, "k2"), [0.045, 0.0, 0.02], rtol=1e-6)
  d64 = np.asarray(d, np.float64)
  np.testing.assert_allclose(kl.kl_estimate(d, "k3"), np.exp(-d64) + d64 - 1, rtol=1e-5)
  with pytest.raises(ValueError, match="estimator"):
    kl.kl_estimate(d, "k4")


def test_per_token_mean_differs_from_k3_of_summed_log_ratio():
  # Row 0: d = (0.2, -0.3): mean k3 = 0.034295, k3(-0.1) = 0.005171. Row 1: one position, they agree.
  logp = np.array([[0.0, -1.8, -6.3], [0.0, -1.8, 0.0]], np.float32)
  ref = np.array([[0.0, -2.0, -6.0], [0.0, -2.0, 0.0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
  per_row = np.asarray(kl.row_kl(logp, ref, mask).per_row_N)
  summed = np.asarray(kl.k3_from_log_ratio(jnp.array([-0.1, 0.2], jnp.float32)))
  np.testing.assert_allclose(per_row[0], 0.034295, atol=1e-6)
  np.testing.assert_allclose(summed[0], math.exp(0.1) - 0.1 - 1, rtol=1e-5)
  assert abs(per_row[0] - summed[0]) > 0.02
  np.testing.assert_allclose(per_row[1], summed[1], rtol=1e-6)


def test_rows_without_masked_positions_give_zero_without_nan():
  mask = np.array([[1, 0], [0, 0]], bool)  # row 0: only column 0 (never scored); row 1: nothing
  out = kl.row_kl(LOGP, REF, mask)
  np.testing.assert_array_equal(out.per_row_N, [0.0, 0.0])
  np.testing.assert_array_equal(out.count_N, [0.0, 0.0])
  grad = jax.grad(lambda lp: kl.row_kl(lp, REF, mask).per_row_N.sum())(LOGP)
  np.testing.assert_array_equal(grad, np.zeros_like(LOGP))


def test_clamps_cap_values_count_tokens_and_stop_their_gradient():
  # Position 1: d = -30 -> clipped to -20, k3 = e^20 - 21 -> capped at kl_max. Position 2: d = 0.1, untouched.
  logp = np.array([[0.0, -40.0, -1.9]], np.float32)
  ref = np.array([[0.0, -10.0, -2.0]], np.float32)
  mask = np.ones((1, 3), bool)
  out = kl.row_kl(logp, ref, mask, log_ratio_clamp=20.0, kl_max=10.0)
  k_small = math.exp(-0.1) + 0.1 - 1
  np.testing.assert_allclose(out.sum_N, [10.0 + k_small], rtol=1e-5)
  assert float(out.clamped) == 1.0
  grad = jax.grad(lambda lp: kl.row_kl(lp, ref, mask).per_row_N.sum())(logp)
  np.testing.assert_allclose(grad, [[0.0, 0.0, (1 - math.exp(-0.1)) / 2]], rtol=1e-4, atol=1e-7)
  # A large positive d: k3(20) = 19 + e^-20 > kl_max, clamped too.
  out = kl.row_kl(np.array([[0.0, -1.0]], np.float32), np.array([[0.0, -26.0]], np.float32), np.ones((1, 2)))
  assert float(out.clamped) == 1.0 and float(out.sum_N[0]) == 10.0


def test_padding_values_change_nothing_including_gradients():
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
  rng = np.random.default_rng(3)
  logp = rng.normal(-2, 1, (2, 4)).astype(np.float32)
  ref = rng.normal(-2, 1, (2, 4)).astype(np.float32)
  junk_logp, junk_ref = logp.copy(), ref.copy()
  junk_logp[~mask], junk_ref[~mask] = np.nan, -np.inf
  junk_logp[:, 0], junk_ref[:, 0] = 1e30, -1e30  # column 0 is never scored either

  def f(lp, r):
    return kl.row_kl(lp, r, mask).per_row_N.sum()

  np.testing.assert_array_equal(f(logp, ref), f(junk_logp, junk_ref))
  np.testing.assert_array_equal(jax.grad(f)(logp, ref), jax.grad(f)(junk_logp, junk_ref))


def test_scored_mask_clears_column_zero_only():
  np.testing.assert_array_equal(kl.scored_mask(np.ones((2, 3))), [[0, 1, 1], [0, 1, 1]])


def test_query_kl_under_jit_matches_eager():
  f = jax.jit(kl.row_kl, static_argnames=("estimator",))
  for estimator in ("k1", "k2", "k3"):
    a, b = f(LOGP, REF, MASK, estimator=estimator), kl.row_kl(LOGP, REF, MASK, estimator=estimator)
    for x, y in zip(a, b):
      np.testing.assert_allclose(x, y, rtol=1e-6)

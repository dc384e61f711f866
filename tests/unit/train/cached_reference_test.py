"""The cached reference is a different XLA program from the step's forward: at step 0 the two differ by
float32 rounding. A batch without reward signal must then leave the policy where it is, as it does with
the reference forward in the step, instead of Adam turning the gradient of that rounding into a full step.

How far the two programs' sums round apart depends on how XLA compiled them (at the suite's backend
optimization level they may agree to the bit), so `no_signal_step` moves every cached log-prob one float32
ulp: a difference of the size the two programs give, on every compiler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import step_test as st
from temperature_rule_test import build_at_step_0, cached_batch
from erpo_jax.algo import kl
from erpo_jax.model import logprobs


def no_signal_step(*overrides):
  """(params before, params after, metrics) of one ERPO step at step 0 on a batch whose every reward is 0,
  with the reference log-probs of the cache computation, each one ulp away."""
  cfg = st.tiny_cfg("erpo.reference=cached", "erpo.kl_on=prompt", "erpo.weights=static", "erpo.alpha=0.5",
                    "optim.weight_decay=0", *overrides)
  step, graphdef, params, _, opt = build_at_step_0(cfg)
  model = nnx.merge(graphdef, params)
  batch, _ = cached_batch(model, st.make_batch())
  ref_logp = np.nextafter(np.asarray(batch.ref_logp), np.float32(-np.inf))  # one ulp of rounding, made sure of
  batch = batch.replace(rewards=jnp.zeros_like(batch.rewards), ref_logp=jnp.asarray(ref_logp))
  before = jax.tree.map(np.array, params)
  new_params, _, m = step(params, opt, None, batch)
  return before, jax.tree.map(np.array, new_params), m


def moved(before, after) -> float:
  return max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_a_cached_reference_step_without_reward_signal_leaves_the_params_where_they_are():
  before, after, m = no_signal_step()
  # The cache and the step's forward do differ, by rounding only: mean k3 ~ d^2 / 2 with |d| ~ 1e-7.
  assert 0 < float(m["kl/query"]) < 1e-9
  assert float(m["reward/zero_std_groups"]) == 1.0
  assert float(m["optim/grad_norm"]) == 0.0
  assert moved(before, after) == 0.0


def test_without_the_tolerance_adam_turns_the_rounding_into_a_step_of_about_lr():
  before, after, m = no_signal_step("erpo.cache_tolerance=0")
  assert 0 < float(m["optim/grad_norm"]) < 1e-4
  assert moved(before, after) > 0.5e-2  # lr = 1e-2: Adam's first step is lr * g / |g| whatever |g| is


def test_the_tolerance_zeroes_log_ratios_within_it_and_shifts_larger_ones_by_it():
  d = jnp.array([[0.0, -0.5, -5e-5, 0.0, 5e-5, 0.3, 2e-4]])
  ref = jnp.zeros_like(d)
  mask = jnp.ones(d.shape, bool)  # column 0 never counts
  tol = 1e-4
  k, _ = kl.token_kl(d, ref, mask, tolerance=tol)
  shifted = np.array([0.0, -0.5 + tol, 0.0, 0.0, 0.0, 0.3 - tol, 1e-4])
  np.testing.assert_allclose(np.asarray(k)[0], np.expm1(-shifted) + shifted, rtol=1e-6, atol=1e-11)
  grad = jax.grad(lambda x: kl.token_kl(x, ref, mask, tolerance=tol)[0].sum())(d)
  np.testing.assert_allclose(np.asarray(grad)[0], np.where(np.arange(7) == 0, 0.0, 1 - np.exp(-shifted)),
                             rtol=1e-5, atol=1e-7)
  assert float(grad[0, 2]) == 0.0 and float(grad[0, 4]) == 0.0
  # tolerance 0 is the exact estimator
  np.testing.assert_array_equal(kl.token_kl(d, ref, mask)[0], kl.token_kl(d, ref, mask, tolerance=0.0)[0])


def test_the_reference_forward_keeps_the_exact_penalty():
  """The tolerance is for the cache only: with erpo.reference=forward a 5e-5 log-ratio is penalised."""
  cfg = st.tiny_cfg("erpo.reference=forward", "erpo.kl_on=prompt", "erpo.weights=static", "erpo.alpha=0.5",
                    "optim.weight_decay=0")
  step, graphdef, params, ref, opt = build_at_step_0(cfg)
  ref = jax.tree.map(lambda x: x * (1 + 1e-5), ref)
  batch = st.make_batch().replace(rewards=jnp.zeros((st.B * st.G,), jnp.float32))
  _, _, m = step(params, opt, ref, batch)
  assert float(m["optim/grad_norm"]) > 0


@pytest.mark.parametrize("value", ["-1e-4", "inf"])
def test_a_negative_or_infinite_cache_tolerance_names_the_field(value):
  from erpo_jax.errors import UserError
  with pytest.raises(UserError, match="erpo.cache_tolerance"):
    st.tiny_cfg(f"erpo.cache_tolerance={value}")


def test_a_cached_step_given_the_reference_logs_the_policy_kl_of_the_forward_step_and_makes_the_same_update():
  """The Policy-KL steps of a cached-reference run: one reference forward, for kl/policy only."""
  batch = st.make_batch()
  common = ("erpo.kl_on=prompt", "erpo.weights=static", "erpo.alpha=0.5")
  fwd_step, _, params, ref, opt = st.build(st.tiny_cfg("erpo.reference=forward", *common))
  _, _, fwd = fwd_step(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt), ref, batch)
  cfg = st.tiny_cfg("erpo.reference=cached", *common)
  plain_step, _, params, ref, opt = st.build(cfg)
  kl_step = st.build(cfg, with_reference=True)[0]
  p_plain, _, plain = plain_step(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt), None, batch)
  p_kl, _, with_kl = kl_step(params, opt, ref, batch)
  assert "kl/policy" not in plain
  assert float(with_kl["kl/policy"]) > 1e-3  # the reference of st.build is another random model
  assert float(with_kl["kl/policy"]) == pytest.approx(float(fwd["kl/policy"]), rel=1e-5)
  # The loss and the update are the cached step's: the reference forward feeds the metric only.
  for key in ("loss/total", "loss/kl", "kl/query", "optim/grad_norm"):
    assert float(with_kl[key]) == pytest.approx(float(plain[key]), rel=1e-6, abs=1e-9), key
  for a, b in zip(jax.tree.leaves(p_kl), jax.tree.leaves(p_plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


def test_one_compiled_cached_step_runs_the_reference_forward_only_on_the_steps_that_log_the_policy_kl():
  """A cached-reference run compiles one update: batch.policy_kl picks whether it runs the reference forward."""
  batch = st.make_batch()
  cfg = st.tiny_cfg("erpo.reference=cached", "erpo.kl_on=prompt", "erpo.weights=static", "erpo.alpha=0.5")
  plain_step, _, params, ref, opt = st.build(cfg)
  p_plain, _, plain = plain_step(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt), None, batch)
  step = st.build(cfg, with_reference=True)[0]
  _, _, logged = step(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt), ref, batch)
  p_skip, _, skipped = step(params, opt, ref, batch.replace(policy_kl=jnp.asarray(False)))
  assert step._cache_size() == 1
  assert float(logged["kl/policy"]) > 1e-3 and np.isnan(float(skipped["kl/policy"]))
  for key in ("loss/total", "loss/kl", "kl/query", "optim/grad_norm"):
    assert float(skipped[key]) == pytest.approx(float(plain[key]), rel=1e-6, abs=1e-9), key
  for a, b in zip(jax.tree.leaves(p_skip), jax.tree.leaves(p_plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


@pytest.mark.parametrize("capacity", [None, 80], ids=["shared-prefix", "packed"])
def test_in_the_shared_prefix_layouts_the_policy_kl_forward_skips_prompt_positions_and_logs_the_same_value(capacity):
  """The cached step's reference forward leaves out the prompt positions' lm-head (the cache has their values):
  kl/policy is still the forward step's, and the loss and the update the cached step's without the forward."""
  batch = st.make_batch()
  N, S = batch.tokens.shape
  prompt_bucket, max_new = 8, 15
  assert logprobs.choose_layout(N, S, group_size=st.G, prompt_bucket=prompt_bucket, response_bucket=max_new,
                                capacity=capacity) != logprobs.PLAIN
  common = ("erpo.kl_on=prompt", "erpo.weights=static", "erpo.alpha=0.5", f"rollout.max_new_tokens={max_new}")
  fwd_step, _, params, ref, opt = st.build(st.tiny_cfg("erpo.reference=forward", *common))
  _, _, fwd = fwd_step(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt), ref, batch, prompt_bucket,
                       capacity)
  cfg = st.tiny_cfg("erpo.reference=cached", *common)
  plain_step, _, params, ref, opt = st.build(cfg)
  kl_step = st.build(cfg, with_reference=True)[0]
  p_plain, _, plain = plain_step(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt), None, batch,
                                 prompt_bucket, capacity)
  p_kl, _, with_kl = kl_step(params, opt, ref, batch, prompt_bucket, capacity)
  assert float(with_kl["kl/policy"]) > 1e-3
  assert float(with_kl["kl/policy"]) == pytest.approx(float(fwd["kl/policy"]), rel=1e-5)
  for key in ("loss/total", "loss/kl", "kl/query", "optim/grad_norm"):
    assert float(with_kl[key]) == pytest.approx(float(plain[key]), rel=1e-6, abs=1e-9), key
  for a, b in zip(jax.tree.leaves(p_kl), jax.tree.leaves(p_plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)

"""Minibatches are optimizer steps normalised over their own tokens; microbatches only save memory."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import step_test as st
from erpo_jax.algo import advantages, losses
from erpo_jax.model import logprobs
from erpo_jax.train import optim


def copies(batch, m):
  """The batch repeated m times along the rows (whole groups, so each minibatch is one copy); scalars kept."""
  return jax.tree.map(lambda x: jnp.concatenate([x] * m) if x.ndim else x, batch)


def test_each_of_m_minibatches_of_m_copies_is_the_step_of_one_copy():
  one = st.make_batch()
  # lr ~ 0: every minibatch sees the same parameters, so its gradient is that of one copy.
  base = ["optim.lr=1e-12", "optim.grad_clip=0", "erpo.weights=none", "erpo.alpha=0.5", "erpo.kl_on=all"]
  step, _, params, ref, opt = st.build(st.tiny_cfg(*base))
  m1 = step(params, opt, ref, one)[2]
  step, _, params, ref, opt = st.build(st.tiny_cfg(*base, f"data.batch_size={3 * st.B}", "ppo.minibatches=3"))
  m3 = step(params, opt, ref, copies(one, 3))[2]
  # Each update's gradient has the norm of one copy's (not a third of it), and its loss is one copy's loss.
  assert float(m3["optim/grad_norm"]) == pytest.approx(float(m1["optim/grad_norm"]), rel=1e-5)
  for key in ("loss/total", "loss/pg", "loss/kl", "kl/query", "kl/policy", "clip/low", "ratio/mean"):
    assert float(m3[key]) == pytest.approx(float(m1[key]), rel=1e-5, abs=1e-6), key  # loss/pg is ~0 here


@pytest.mark.parametrize("weights", ["static", pytest.param("dynamic", marks=pytest.mark.slow)])
def test_microbatches_1_2_4_give_the_same_update(weights):
  batch = st.make_batch(seed=3, n=4 * st.G)
  out = {}
  for k in (1, 2, 4):
    # Adam divides each gradient element by its size: with its default eps = 1e-8 an element near 0 turns a
    # float rounding difference of the summation order into a visible step; eps = 1e-3 keeps the update a
    # smooth function of the gradient, so equal gradients show as equal updates.
    cfg = st.tiny_cfg("data.batch_size=4", f"ppo.microbatches={k}", f"erpo.weights={weights}", "erpo.kl_on=all",
                      "erpo.alpha=0.5", "optim.lr=1e-3", "optim.eps=1e-3")
    step, _, params, ref, opt = st.build(cfg)
    new_params, _, metrics = step(params, opt, ref, batch)
    out[k] = ([np.asarray(x) for x in jax.tree.leaves(new_params)], {n: float(v) for n, v in metrics.items()})
  for k in (2, 4):
    for a, b in zip(out[1][0], out[k][0]):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    for name, value in out[1][1].items():
      assert out[k][1][name] == pytest.approx(value, rel=1e-5, abs=5e-5), (k, name)  # ratio: 1 +- float noise


@pytest.mark.slow
def test_logged_grad_norm_is_the_norm_of_the_gradient_that_is_clipped_and_applied():
  cfg = st.tiny_cfg("data.batch_size=4", "ppo.microbatches=2", "erpo.weights=static", "erpo.alpha=0.5",
                    "optim.lr=1e-2", "optim.grad_clip=0.05")
  step, graphdef, params, ref, opt = st.build(cfg)
  batch = st.make_batch(seed=4, n=4 * st.G)

  def loss(p):
    prompt_len = batch.prompt_mask.sum(axis=1)
    logp = logprobs.log_probs(nnx.merge(graphdef, p), batch.tokens, prompt_len_N=prompt_len, chunk=40)
    ref_logp = logprobs.log_probs(nnx.merge(graphdef, ref), batch.tokens, prompt_len_N=prompt_len, chunk=40)
    adv = advantages.group_advantages(batch.rewards, st.G)
    return losses.erpo_loss(logp, jax.lax.stop_gradient(logp), ref_logp, batch.prompt_mask, batch.response_mask,
                            adv, batch.static_weight, alpha=0.5)[0]

  grads = jax.grad(loss)(params)
  tx, _ = optim.make_optimizer(cfg.optim, cfg.train.steps)
  updates, _ = tx.update(grads, tx.init(params), params)
  want_params = optax.apply_updates(params, updates)
  want_norm = float(optax.tree.norm(grads))
  assert want_norm > 0.05  # the clip is active
  new_params, _, metrics = step(params, opt, ref, batch)
  assert float(metrics["optim/grad_norm"]) == pytest.approx(want_norm, rel=1e-5)
  # The step sums two microbatches' gradients, the reference one batch's: the same terms in another order.
  # Adam's first step is lr * g / (|g| + eps) per element, so an element's rounding difference moves it by
  # up to lr * that difference / |g|: on an AVX-512 Xeon one of 4096 elements differed by 1.2e-6 (1.2e-4
  # of lr = 1e-2). 1e-5 is 1e-3 of lr; a gradient missing a microbatch moves most elements by far more.
  for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(new_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)

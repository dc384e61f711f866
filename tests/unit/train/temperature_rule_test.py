"""One log-prob rule in every mode: prompts at temperature 1, responses at the sampling temperature.

At step 0 the policy is the reference, so for any rollout.temperature and either
reference mode (a forward in the step, or the cached reference prompt log-probs
of `erpo-jax weights`) the Query-KL is 0, the update equals the one computed
from log-probs written out by hand, and the dynamic weights' prompt NLLs are
the static weights' NLLs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import step_test as st
from erpo_jax.algo import advantages, losses, weights
from erpo_jax.data import reference_cache, reference_pass
from erpo_jax.model import llama, logprobs


def hand_log_probs(model, tokens_NxS, prompt_len_N, temperature):
  """log softmax(logits) at prompt positions, log softmax(logits / T) after: the rule, without model.logprobs."""
  logits = jnp.einsum("nsd,vd->nsv", model.hidden(tokens_NxS), model.unembed_rows(),
                      preferred_element_type=jnp.float32)[:, :-1]
  t_S1 = jnp.arange(1, tokens_NxS.shape[1])
  scale = jnp.where(t_S1[None, :, None] < prompt_len_N[:, None, None], 1.0, 1.0 / temperature)
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits * scale, axis=-1), tokens_NxS[:, 1:, None], axis=-1)[..., 0]
  return jnp.concatenate([jnp.zeros((tokens_NxS.shape[0], 1)), logp], axis=1)


def cached_batch(model, batch):
  """The batch with ref_logp and static weights from the reference cache computation, as assemble_batch fills them."""
  prompt_len = np.asarray(batch.prompt_mask).sum(axis=1)
  tokens = np.asarray(batch.tokens)
  prompts = [tokens[n, :prompt_len[n]].tolist() for n in range(0, len(tokens), st.G)]
  logp_QxL, lengths = reference_pass.compute_reference_logp(model, prompts, chunk=40, progress=False)
  cache = reference_cache.build_cache(logp_QxL, lengths, 0.0, 2.0, keys={})
  ref = np.zeros(tokens.shape, np.float32)
  for n in range(len(tokens)):
    q = n // st.G
    ref[n, :lengths[q]] = logp_QxL[q, :lengths[q]]
  return batch.replace(ref_logp=jnp.asarray(ref), static_weight=jnp.asarray(np.repeat(cache.weights, st.G))), cache


def build_at_step_0(cfg):
  """The step with the reference = the policy (a copy of the same weights)."""
  step, graphdef, params, _, opt = st.build(cfg)
  ref = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
  return step, graphdef, params, ref, opt


@pytest.mark.parametrize("temperature, reference", [
    pytest.param(0.6, "forward", marks=pytest.mark.slow), (0.6, "cached"), pytest.param(1.0, "forward", marks=pytest.mark.slow),
    pytest.param(1.0, "cached", marks=pytest.mark.slow), pytest.param(1.4, "forward", marks=pytest.mark.slow),
    pytest.param(1.4, "cached", marks=pytest.mark.slow)])
def test_query_kl_is_zero_at_step_0_and_the_update_matches_hand_log_probs(temperature, reference):
  cfg = st.tiny_cfg(f"rollout.temperature={temperature}", f"erpo.reference={reference}", "erpo.kl_on=prompt",
                    "erpo.weights=static", "erpo.alpha=0.5")
  step, graphdef, params, ref, opt = build_at_step_0(cfg)
  model = nnx.merge(graphdef, params)
  batch, _ = cached_batch(model, st.make_batch())
  prompt_len = batch.prompt_mask.sum(axis=1)

  def hand_loss(p):
    logp = hand_log_probs(nnx.merge(graphdef, p), batch.tokens, prompt_len, temperature)
    ref_logp = jax.lax.stop_gradient(hand_log_probs(nnx.merge(graphdef, ref), batch.tokens, prompt_len,
                                                    temperature))
    adv = advantages.group_advantages(batch.rewards, st.G)
    return losses.erpo_loss(logp, jax.lax.stop_gradient(logp), ref_logp, batch.prompt_mask, batch.response_mask,
                            adv, batch.static_weight, alpha=0.5, kl_on="prompt")[0]

  want_loss, want_grads = jax.value_and_grad(hand_loss)(params)
  want_norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(want_grads))))
  _, _, m = step(params, opt, ref if reference == "forward" else None, batch)
  assert abs(float(m["kl/query"])) < 1e-6
  assert abs(float(m["loss/kl"])) < 1e-6
  assert float(m["loss/total"]) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-6)
  assert float(m["optim/grad_norm"]) == pytest.approx(want_norm, rel=1e-4)


@pytest.mark.parametrize("temperature", [0.6, 1.4])
def test_dynamic_weights_at_step_0_use_the_static_weights_nlls(temperature):
  cfg = st.tiny_cfg(f"rollout.temperature={temperature}", "erpo.weights=dynamic")
  step, graphdef, params, ref, opt = build_at_step_0(cfg)
  batch, cache = cached_batch(nnx.merge(graphdef, params), st.make_batch())
  nll_N = np.repeat(cache.nll, st.G)
  _, _, m = step(params, opt, ref, batch)
  np.testing.assert_allclose([m["prompt_nll/mean"], m["prompt_nll/min"], m["prompt_nll/max"]],
                             [nll_N.mean(), nll_N.min(), nll_N.max()], rtol=1e-5)
  # and the weights are s_bar / s_q of those NLLs over the batch
  w_N = weights.dynamic_weights(jnp.asarray(nll_N), jnp.ones(len(nll_N), bool))
  np.testing.assert_allclose([m["weight/min"], m["weight/max"]], [float(w_N.min()), float(w_N.max())], rtol=1e-5)


def test_log_probs_at_another_temperature_need_the_prompt_lengths():
  model = llama.init_random(llama.model_config_from_random_init(st.tiny_cfg().model.random_init))
  with pytest.raises(ValueError, match="prompt_len_N"):
    logprobs.log_probs(model, jnp.zeros((2, 8), jnp.int32), temperature=0.7)

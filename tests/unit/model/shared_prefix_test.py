"""Shared-prefix log-probs equal the plain [N, S] layout: values, entropies, ERPO loss and every gradient."""

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from erpo_jax import buckets
from erpo_jax.algo import losses
from erpo_jax.model import llama, logprobs, shared_prefix
from erpo_jax.model.config import ModelConfig

B, G, S, P, R, V = 3, 4, 26, 10, 12, 97
TOL = 1e-5  # float32: the layouts add the same terms in different orders

LLAMA = ModelConfig(architecture="llama", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=64)
QWEN2 = ModelConfig(architecture="qwen2", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1,
                    head_dim=8, intermediate_size=48, attention_bias=True, tie_word_embeddings=False)


def make_rows(seed=0, b=B, g=G, s=S, p=P, r=R):
  """Group-contiguous rows: prompts of different lengths (one fills P), responses up to R (one fills R)."""
  rng = np.random.default_rng(seed)
  n = b * g
  tokens = rng.integers(1, V, (n, s)).astype(np.int32)
  prompt_len = rng.integers(2, p, b)
  prompt_len[0] = p
  prompt_len = prompt_len.repeat(g)
  response_len = rng.integers(1, r + 1, n)
  response_len[-1] = r
  for i in range(0, n, g):  # the G rows of a prompt share it
    tokens[i + 1:i + g, :prompt_len[i]] = tokens[i, :prompt_len[i]]
  pos = np.arange(s)[None]
  prompt_mask = pos < prompt_len[:, None]
  response_mask = (pos >= prompt_len[:, None]) & (pos < (prompt_len + response_len)[:, None])
  tokens = np.where(prompt_mask | response_mask, tokens, 0)
  return jnp.asarray(tokens), jnp.asarray(prompt_len), prompt_mask, response_mask


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _both(graph, state, tokens, prompt_len, g, temperature, p_r=(P, R)):
  model = nnx.merge(graph, state)
  plain = logprobs.log_probs(model, tokens, prompt_len_N=prompt_len, chunk=16, temperature=temperature,
                             with_entropy=True)
  shared = shared_prefix.shared_prefix_log_probs(model, tokens, prompt_len, g, prompt_bucket=p_r[0],
                                                 response_bucket=p_r[1], chunk=16, temperature=temperature,
                                                 with_entropy=True)
  return plain, shared


def both_layouts(model, tokens, prompt_len, g=G, temperature=1.0, p_r=(P, R)):
  graph, state = nnx.split(model)
  return jax.tree.map(np.asarray, _both(graph, state, tokens, prompt_len, g, temperature, p_r))


def tiny_model(cfg, seed, remat=False):
  """A random model with embeddings scaled to 0.1: log-probs of a few nats, as in a trained model.

  The unit-variance init gives logits of std sqrt(D) and log-probs near -30, where float32
  round-off of 1e-6 relative becomes 1e-5 absolute and then a relative error of exp(logp - old)
  in the loss; that would test the init, not the layout.
  """
  model = llama.init_random(cfg, seed=seed, remat=remat)
  model.embed[...] = 0.1 * model.embed[...]
  if not cfg.tie_word_embeddings:
    model.lm_head[...] = 0.1 * model.lm_head[...]
  return model


def assert_close(a, b, mask=None, name=""):
  """max |a - b| < TOL over the mask."""
  a, b = np.asarray(a), np.asarray(b)
  mask = np.ones(a.shape, bool) if mask is None else mask
  diff = np.abs(np.where(mask, a - b, 0)).max()
  assert diff < TOL, f"{name}: max |diff| {diff:.3g}, values up to {np.abs(np.where(mask, a, 0)).max():.3g}"


def scored(prompt_mask, response_mask):
  """Positions whose log-prob any loss reads: prompt or response, never column 0."""
  return (prompt_mask | response_mask) & (np.arange(prompt_mask.shape[1])[None] >= 1)


@pytest.mark.parametrize("cfg, temperature", [(LLAMA, 1.0), (QWEN2, 0.7)], ids=["llama", "qwen2-bias-untied"])
def test_log_probs_and_entropy_equal_plain_layout(cfg, temperature):
  tokens, prompt_len, pm, rm = make_rows(seed=1)
  (lp_a, ent_a), (lp_b, ent_b) = both_layouts(tiny_model(cfg, seed=3), tokens, prompt_len,
                                              temperature=temperature)
  mask = scored(pm, rm)
  assert lp_b.shape == ent_b.shape == (B * G, S)
  assert_close(lp_a, lp_b, mask)
  assert_close(ent_a, ent_b, mask)
  assert np.all(lp_b < -1, where=mask) and np.all(ent_b > 1, where=mask)  # real values, not zeros


def test_positions_outside_prompt_and_response_bucket_are_zero():
  tokens, prompt_len, pm, rm = make_rows(seed=2)
  _, (lp, ent) = both_layouts(tiny_model(LLAMA, seed=0), tokens, prompt_len)
  t = np.arange(S)[None]
  outside = (t == 0) | (t >= np.asarray(prompt_len)[:, None] + R)
  assert outside.any() and np.all(lp[outside] == 0) and np.all(ent[outside] == 0)


def test_group_size_one_equals_plain_layout():
  tokens, prompt_len, pm, rm = make_rows(seed=4, b=5, g=1)
  (lp_a, _), (lp_b, _) = both_layouts(tiny_model(LLAMA, seed=0), tokens, prompt_len, g=1)
  assert_close(lp_a, lp_b, scored(pm, rm))


def test_rows_that_are_not_whole_groups_raise():
  model = tiny_model(LLAMA, seed=0)
  tokens, prompt_len, _, _ = make_rows()
  with pytest.raises(ValueError, match="whole groups"):
    shared_prefix.shared_prefix_log_probs(model, tokens[:-1], prompt_len[:-1], G, prompt_bucket=P,
                                          response_bucket=R)


def _loss(state, graph, shared, tokens, prompt_len, pm, rm, old, ref, adv, w, kl_on):
  model = nnx.merge(graph, state)
  if shared == "packed":
    response_len = rm.sum(axis=1)
    logp, ent = shared_prefix.packed_log_probs(model, tokens, prompt_len, response_len, G, prompt_bucket=P,
                                               response_bucket=R, capacity=PACKED_CAPACITY, chunk=16,
                                               with_entropy=True)
  elif shared == "streams":  # one packed stream per group, as on a mesh of B batch shards
    layout = logprobs.Layout(G, P, R, capacity=STREAM_CAPACITY, streams=B)
    logp, ent = logprobs.log_probs(model, tokens, prompt_len_N=prompt_len, response_len_N=rm.sum(axis=1), chunk=16,
                                   layout=layout, with_entropy=True)
  elif shared:
    logp, ent = shared_prefix.shared_prefix_log_probs(model, tokens, prompt_len, G, prompt_bucket=P,
                                                      response_bucket=R, chunk=16, with_entropy=True)
  else:
    logp, ent = logprobs.log_probs(model, tokens, chunk=16, with_entropy=True)
  loss, _ = losses.erpo_loss(logp, old, ref, pm, rm, adv, w, alpha=0.5, kl_on=kl_on, entropy_NxS=ent,
                             entropy_coef=0.1)
  return loss


_value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=(1, 2, 11))


@pytest.mark.parametrize("cfg, kl_on, remat, layout", [
    (LLAMA, "prompt", False, True), pytest.param(QWEN2, "all", True, True, marks=pytest.mark.slow),
    (LLAMA, "all", False, "packed"), (QWEN2, "response", "dots", "packed"), (LLAMA, "all", "dots", "streams")],
    ids=["llama-query-kl", "qwen2-all-kl-remat", "packed-llama-all-kl", "packed-qwen2-response-kl-remat-dots",
         "packed-streams-llama-all-kl-remat-dots"])
def test_erpo_loss_and_every_gradient_equal_plain_layout(cfg, kl_on, remat, layout):
  # The prompt is computed once per group in the shared layout; its gradient must still collect
  # the contributions of all G copies (Query-KL counts every row, and responses attend to it).
  tokens, prompt_len, pm, rm = make_rows(seed=5)
  model = tiny_model(cfg, seed=7, remat=remat)
  graph, state = nnx.split(model)
  rng = np.random.default_rng(0)
  logp0 = np.asarray(logprobs.log_probs(model, tokens, chunk=16))
  mask = scored(pm, rm)
  old = np.where(mask, logp0 + rng.normal(0, 0.1, logp0.shape), 0).astype(np.float32)
  ref = np.where(mask, logp0 + rng.normal(0, 0.3, logp0.shape), 0).astype(np.float32)
  adv = rng.normal(size=B * G).astype(np.float32)
  w = rng.uniform(0.5, 2.0, B * G).astype(np.float32)
  args = (tokens, prompt_len, pm, rm, old, ref, adv, w, kl_on)
  loss_a, grads_a = _value_and_grad(state, graph, False, *args)
  loss_b, grads_b = _value_and_grad(state, graph, layout, *args)
  assert_close(loss_a, loss_b)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_a), jax.tree.leaves(grads_b)):
    assert float(jnp.abs(a).max()) > 1e-3, jax.tree_util.keystr(path)  # a real gradient reaches every leaf
    assert_close(a, b, name=jax.tree_util.keystr(path))


PACKED_CAPACITY = 96  # >= the 80 response tokens of make_rows(seed=5), < N*R = 144 slots
STREAM_CAPACITY = 32  # >= the 20, 30, 30 response tokens of each group of make_rows(seed=5), < G*R = 48 slots


@pytest.mark.parametrize("cfg, slack", [(LLAMA, 0), (QWEN2, 7)], ids=["llama-exact-capacity", "qwen2-spare-slots"])
def test_packed_responses_equal_plain_layout_and_are_zero_after_each_response(cfg, slack):
  tokens, prompt_len, pm, rm = make_rows(seed=1)
  model = tiny_model(cfg, seed=3)
  response_len = jnp.asarray(rm.sum(axis=1))
  capacity = int(response_len.sum()) + slack
  assert capacity < B * G * R  # fewer slots than the unpacked [N, R] response rows
  plain = logprobs.log_probs(model, tokens, chunk=16, with_entropy=True)
  packed = shared_prefix.packed_log_probs(model, tokens, prompt_len, response_len, G, prompt_bucket=P,
                                          response_bucket=R, capacity=capacity, chunk=16, with_entropy=True)
  mask = scored(pm, rm)
  for a, b in zip(plain, packed):
    assert_close(np.asarray(a), np.asarray(b), mask)
    assert np.all(np.asarray(b)[~mask] == 0)


def test_one_packed_stream_per_group_equals_plain_layout_and_each_stream_packs_only_its_rows():
  tokens, prompt_len, pm, rm = make_rows(seed=1)
  model = tiny_model(LLAMA, seed=3)
  response_len = jnp.asarray(rm.sum(axis=1))
  per_group = np.asarray(response_len).reshape(B, G).sum(axis=1)  # 22, 36, 33 tokens
  capacity = int(per_group.max())
  assert capacity < int(response_len.sum()) and capacity < G * R  # one stream of the batch would not fit
  layout = logprobs.choose_layout(B * G, S, group_size=G, prompt_bucket=P, response_bucket=R, capacity=capacity,
                                  streams=logprobs.packed_streams(B, 3))
  assert layout == logprobs.Layout(G, P, R, capacity, streams=3)  # 3 groups on 3 batch shards
  plain = logprobs.log_probs(model, tokens, chunk=16, with_entropy=True)
  packed = logprobs.log_probs(model, tokens, prompt_len_N=prompt_len, response_len_N=response_len, chunk=16,
                              layout=layout, with_entropy=True)
  mask = scored(pm, rm)
  for a, b in zip(plain, packed):
    assert_close(np.asarray(a), np.asarray(b), mask)
    assert np.all(np.asarray(b)[~mask] == 0)


def test_packed_streams_hold_whole_groups_and_fall_back_when_they_cannot():
  # One stream per batch shard, or none when the shards cannot hold whole groups.
  assert [logprobs.packed_streams(b, shards) for b, shards in ((4, 1), (4, 2), (8, 4), (4, 8), (6, 4))] == [1, 2, 4, 0, 0]
  kw = dict(group_size=G, prompt_bucket=P, response_bucket=R)
  assert logprobs.choose_layout(12, S, capacity=40, streams=3, **kw).streams == 3
  # 3 groups do not split into 2 streams of whole groups: the shared prefix runs unpacked.
  assert logprobs.choose_layout(12, S, capacity=40, streams=2, **kw).capacity == 0
  # A stream's capacity must be below its own [N / streams, R] rows.
  assert logprobs.choose_layout(12, S, capacity=48, streams=3, **kw).capacity == 0
  assert logprobs.choose_layout(12, S, capacity=40, streams=0, **kw) == logprobs.Layout(G, P, R)


def test_packed_capacity_pads_under_a_sixteenth_of_the_power_of_two_with_at_most_8_values_an_octave():
  assert [buckets.packed_capacity(n, 4096) for n in (1, 128, 129, 600, 1350, 1427, 1539, 1662, 2049)] == [
      128, 128, 256, 640, 1408, 1536, 1664, 1664, 2304]
  assert buckets.packed_capacity(3000, 2048) == 2048 and buckets.packed_capacity(20000, 10**6) == 20480
  for n in range(1, 70000, 7):
    c = buckets.packed_capacity(n, 10**6)
    assert n <= c and c - n < max(128, buckets.power_of_two(n) // 16)
  octave = {buckets.packed_capacity(n, 10**6) for n in range(4097, 8193)}
  assert sorted(octave) == list(range(4608, 8193, 512))


def test_stream_index_is_a_bijection_between_response_tokens_and_slots():
  response_len = jnp.array([3, 0, 5, 2])
  idx, inv = shared_prefix.stream_index(response_len, R=5, C=12)
  idx, inv = np.asarray(idx).reshape(4, 5), np.asarray(inv)
  assert idx[0].tolist() == [0, 1, 2, 12, 12] and idx[1].tolist() == [12] * 5
  assert idx[2].tolist() == [3, 4, 5, 6, 7] and idx[3].tolist() == [8, 9, 12, 12, 12]
  assert inv.tolist() == [0, 1, 2, 10, 11, 12, 13, 14, 15, 16, 20, 20]  # slots 10, 11 unused (K = 20)


@pytest.mark.slow
def test_shared_layout_needs_fewer_flops():
  # Tokens run: plain N*S = 12*26 = 312; shared B*P + N*R = 30 + 144 = 174 (about 0.56x).
  tokens, prompt_len, _, _ = make_rows()
  graph, state = nnx.split(tiny_model(LLAMA, seed=0))

  def flops(shared):
    def f(state):
      model = nnx.merge(graph, state)
      if shared:
        return shared_prefix.shared_prefix_log_probs(model, tokens, prompt_len, G, prompt_bucket=P,
                                                     response_bucket=R, chunk=16)[0].sum()
      return logprobs.log_probs(model, tokens, chunk=16).sum()
    cost = jax.jit(jax.grad(f)).lower(state).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]

  assert flops(True) < 0.75 * flops(False)


def _response_loss(state, graph, layout, prompt_grads, tokens, prompt_len, pm, rm, old, adv, w, kl_on):
  """ERPO loss with a penalty that reads no prompt position (kl_on response or none), entropy bonus on."""
  model = nnx.merge(graph, state)
  logp, ent = logprobs.log_probs(model, tokens, prompt_len_N=prompt_len, response_len_N=rm.sum(axis=1), chunk=16,
                                 temperature=0.8, layout=layout, with_entropy=True, prompt_grads=prompt_grads)
  loss, _ = losses.erpo_loss(logp, old, logp, pm, rm, adv, w, alpha=0.5, kl_on=kl_on, entropy_NxS=ent,
                             entropy_coef=0.1)
  return loss + 0.3 * jnp.sum(jnp.where(rm, logp, 0.0)), logp


_response_value_and_grad = jax.jit(jax.value_and_grad(_response_loss, has_aux=True), static_argnums=(1, 2, 3, 11))

LAYOUTS = {"shared": logprobs.Layout(G, P, R), "packed": logprobs.Layout(G, P, R, capacity=PACKED_CAPACITY)}


@pytest.mark.parametrize("layout, kl_on", [("shared", "response"), ("packed", "none")])
def test_a_loss_of_response_positions_has_the_same_value_and_gradients_without_prompt_grads(layout, kl_on):
  tokens, prompt_len, pm, rm = make_rows(seed=5)
  graph, state = nnx.split(tiny_model(LLAMA, seed=7, remat="dots"))
  rng = np.random.default_rng(1)
  mask = scored(pm, rm)
  logp0 = np.asarray(logprobs.log_probs(nnx.merge(graph, state), tokens, chunk=16))
  old = np.where(mask, logp0 + rng.normal(0, 0.1, logp0.shape), 0).astype(np.float32)
  args = (tokens, prompt_len, pm, rm, old, rng.normal(size=B * G).astype(np.float32),
          rng.uniform(0.5, 2.0, B * G).astype(np.float32), kl_on)
  (loss_a, logp_a), grads_a = _response_value_and_grad(state, graph, LAYOUTS[layout], True, *args)
  (loss_b, logp_b), grads_b = _response_value_and_grad(state, graph, LAYOUTS[layout], False, *args)
  assert_close(logp_a, logp_b, mask, "log-probs")  # prompt positions included: the values do not change
  assert np.all(np.asarray(logp_b) < -1, where=mask)
  assert_close(loss_a, loss_b, name="loss")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_a), jax.tree.leaves(grads_b)):
    assert float(jnp.abs(a).max()) > 1e-3, jax.tree_util.keystr(path)
    assert_close(a, b, name=jax.tree_util.keystr(path))


def _lm_head_backward_chunks(jaxpr, V, D) -> list[int]:
  """Lengths of the scans in a jaxpr (nested ones included) that carry a float32 [V, D] sum: the lm-head's
  backward chunk loops (lm_head._chunked_bwd)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      carries = eqn.params["jaxpr"].in_avals[eqn.params["num_consts"]:][:eqn.params["num_carry"]]
      if any(a.shape == (V, D) and a.dtype == jnp.float32 for a in carries):
        found.append(eqn.params["length"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _lm_head_backward_chunks(sub, V, D)
  return found


def test_without_prompt_grads_prompt_positions_get_no_gradient_and_the_backward_runs_only_response_chunks():
  tokens, prompt_len, pm, rm = make_rows(seed=5)
  graph, state = nnx.split(tiny_model(LLAMA, seed=7))
  layout = logprobs.Layout(G, P, R)

  def prompt_sum(state, prompt_grads):
    logp = logprobs.log_probs(nnx.merge(graph, state), tokens, prompt_len_N=prompt_len, chunk=16, layout=layout,
                              prompt_grads=prompt_grads)
    return jnp.sum(jnp.where(pm, logp, 0.0)) + 0.0 * jnp.sum(jnp.where(rm, logp, 0.0))

  with_grads = jax.grad(prompt_sum)(state, True)
  without = jax.grad(prompt_sum)(state, False)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(with_grads)) > 1e-2
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(without))
  # B (P - 1) = 27 prompt and N R = 144 response positions, 16 per chunk: 11 chunks together, 9 of responses.
  D = LLAMA.hidden_size
  chunks = lambda prompt_grads: _lm_head_backward_chunks(
      jax.make_jaxpr(jax.grad(functools.partial(prompt_sum, prompt_grads=prompt_grads)))(state).jaxpr, V, D)
  assert chunks(True) == [11]
  assert chunks(False) == [9]


def _lm_head_forward_chunks(jaxpr, V, D) -> list[int]:
  """Lengths of the loops in a jaxpr (nested ones included) that map a [V, D] unembedding over token chunks
  with no carry: the lm-head's forward chunk loops (lm_head._forward)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and eqn.params["num_carry"] == 0:
      consts = eqn.params["jaxpr"].in_avals[:eqn.params["num_consts"]]
      if any(a.shape == (V, D) for a in consts):
        found.append(eqn.params["length"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _lm_head_forward_chunks(sub, V, D)
  return found


@pytest.mark.parametrize("layout", ["shared", "packed"])
def test_without_prompt_positions_responses_keep_their_values_prompts_are_zero_and_only_their_chunks_run(layout):
  tokens, prompt_len, pm, rm = make_rows(seed=5)
  model = tiny_model(QWEN2, seed=2)
  response_len = jnp.asarray(rm.sum(axis=1))

  def run(prompt_positions):
    return logprobs.log_probs(model, tokens, prompt_len_N=prompt_len, response_len_N=response_len, chunk=16,
                              temperature=0.7, layout=LAYOUTS[layout], with_entropy=True,
                              prompt_positions=prompt_positions)

  (logp, ent), (logp_r, ent_r) = run(True), run(False)
  assert np.all(np.asarray(logp_r) < -1, where=rm)
  assert_close(logp_r, logp, rm, "response log-probs")
  assert_close(ent_r, ent, rm, "response entropies")
  assert np.all(np.asarray(logp_r)[pm] == 0.0) and np.all(np.asarray(ent_r)[pm] == 0.0)
  assert np.all(np.asarray(logp)[pm & (np.arange(S)[None] >= 1)] < 0)
  # B (P - 1) = 27 prompt positions and N R = 144 response slots (96 packed), 16 per chunk.
  chunks = lambda prompt_positions: sum(_lm_head_forward_chunks(
      jax.make_jaxpr(lambda: run(prompt_positions))().jaxpr, V, QWEN2.hidden_size))
  response_slots = PACKED_CAPACITY if layout == "packed" else B * G * R
  assert chunks(False) == -(-response_slots // 16)
  assert chunks(True) == -(-(B * (P - 1) + response_slots) // 16)

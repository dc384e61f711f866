"""Tests of the ERPO/GRPO loss, its aggregation and its metrics (erpo_jax.algo.losses)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.algo import diagnostics, kl, losses, weights

MODES = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"]


def _worked_example():
  """SPEC example: columns = [first prompt token, the valid prompt position, one response token]."""
  logp = np.array([[0.0, -1.8, -0.7], [0.0, -6.3, -1.1]], np.float32)
  ref = np.array([[0.0, -2.0, -0.5], [0.0, -6.0, -1.0]], np.float32)
  prompt = np.array([[1, 1, 0], [1, 1, 0]], bool)
  response = np.array([[0, 0, 1], [0, 0, 1]], bool)
  return logp, ref, prompt, response


def test_worked_example_through_query_kl_and_static_weights():
  logp, ref, prompt, _ = _worked_example()
  d_N = kl.row_kl(logp, ref, prompt).per_row_N  # 0.018731, 0.049859
  ref_nll_Q, _ = weights.prompt_nll(ref, prompt)  # s = 2, 6
  w_N = weights.static_weights(ref_nll_Q)  # 2, 2/3
  j_N = jnp.array([0.3, 0.6])
  # L = (1/B) sum w (-J) + alpha (1/B) sum D = -0.5 + 0.1 * 0.034295
  loss = jnp.mean(w_N * -j_N) + 0.1 * jnp.mean(d_N)
  np.testing.assert_allclose(d_N, [0.018731, 0.049859], atol=1e-6)
  np.testing.assert_allclose(w_N, [2.0, 2 / 3], rtol=1e-6)
  np.testing.assert_allclose(loss, -0.496571, atol=1e-6)


def test_worked_example_through_erpo_loss():
  # One response token per row with ratio 1 and advantage J_i: L_pg(i) = -J_i.
  logp, ref, prompt, response = _worked_example()
  loss, metrics = losses.erpo_loss(logp, logp, ref, prompt, response, jnp.array([0.3, 0.6]),
                                   jnp.array([2.0, 2 / 3]), alpha=0.1)
  np.testing.assert_allclose(loss, -0.496571, atol=1e-6)
  w, adv = jnp.array([2.0, 2 / 3]), jnp.array([0.3, 0.6])
  metrics.update(diagnostics.pg_diagnostics(logp, logp, adv, response))
  metrics.update(diagnostics.erpo_diagnostics(logp, ref, prompt, response, w))
  m = diagnostics.finalize_metrics(metrics)
  np.testing.assert_allclose(m["kl/query"], 0.034295, atol=1e-6)
  np.testing.assert_allclose(m["loss/kl"], 0.034295, atol=1e-6)
  np.testing.assert_allclose(m["loss/pg"], -0.5, atol=1e-6)
  np.testing.assert_allclose(m["loss/total"], -0.496571, atol=1e-6)
  # Policy-KL is logged although not penalised: d = -0.2, -0.1 on the response tokens.
  np.testing.assert_allclose(m["kl/policy"], np.mean(np.expm1([0.2, 0.1]) - [0.2, 0.1]), rtol=1e-5)
  np.testing.assert_allclose([m["weight/mean"], m["weight/min"], m["weight/max"]], [4 / 3, 2 / 3, 2.0],
                             rtol=1e-6)
  np.testing.assert_allclose([m["prompt_nll/mean"], m["prompt_nll/min"], m["prompt_nll/max"]], [4.05, 1.8, 6.3],
                             rtol=1e-6)
  np.testing.assert_allclose([m["ratio/mean"], m["ratio/min"], m["ratio/max"]], [1.0, 1.0, 1.0])
  for name in ("clip/low", "clip/high", "clip/dual", "kl/clamped_frac"):
    assert float(m[name]) == 0.0


def test_erpo_loss_gradient_flows_through_logp_only():
  logp, ref, prompt, response = _worked_example()
  adv, w = jnp.array([0.3, 0.6]), jnp.array([2.0, 2 / 3])

  def f(lp, old, r, a, wt):
    return losses.erpo_loss(lp, old, r, prompt, response, a, wt, alpha=0.1)[0]

  g_logp, g_old, g_ref, g_adv, g_w = jax.grad(f, argnums=(0, 1, 2, 3, 4))(logp, logp, ref, adv, w)
  # Prompt: alpha / B * (1 - e^-d), d = 0.2, -0.3. Response at ratio 1: -w_i A_i / B = -0.3, -0.2.
  want = [[0.0, 0.05 * (1 - math.exp(-0.2)), -0.3], [0.0, 0.05 * (1 - math.exp(0.3)), -0.2]]
  np.testing.assert_allclose(g_logp, want, rtol=1e-5, atol=1e-7)
  for g in (g_old, g_ref, g_adv, g_w):
    np.testing.assert_array_equal(g, np.zeros_like(g))


@pytest.mark.parametrize("kl_on", ["prompt", "response", "all", "none"])
def test_kl_on_penalises_exactly_the_stated_tokens(kl_on):
  logp, ref, prompt, response = _worked_example()
  # Advantages 0: the task term has no gradient, so only penalised tokens get one.
  grad = jax.grad(lambda lp: losses.erpo_loss(lp, lp, ref, prompt, response, jnp.zeros(2), alpha=1.0,
                                              kl_on=kl_on)[0])(logp)
  cols = {"prompt": [1], "response": [2], "all": [1, 2], "none": []}[kl_on]
  expected = np.zeros((2, 3), bool)
  expected[:, cols] = True
  np.testing.assert_array_equal(np.asarray(grad) != 0, expected)


def test_weights_none_means_ones():
  logp, ref, prompt, response = _worked_example()
  a = losses.erpo_loss(logp, logp, ref, prompt, response, jnp.array([0.3, -0.6]), None)
  b = losses.erpo_loss(logp, logp, ref, prompt, response, jnp.array([0.3, -0.6]), jnp.ones(2))
  np.testing.assert_allclose(a[0], b[0])
  np.testing.assert_allclose(a[1]["loss/pg/sum"], b[1]["loss/pg/sum"])


def test_clipped_pg_loss_hand_values():
  # r = e^(logp - old). A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2; A=-1, r=0.5 -> max(0.5, 0.8) = 0.8;
  # A=-1, r=5 -> max(5, 1.2) = 5, dual clip c=3 -> min(5, 3) = 3; A=+1, r=1.1 inside -> -1.1.
  r = np.array([1.5, 0.5, 5.0, 1.1], np.float32)
  logp = np.zeros((4, 2), np.float32)
  logp[:, 1] = np.log(r)
  old, mask, adv = np.zeros((4, 2), np.float32), np.ones((4, 2), bool), np.array([1.0, -1.0, -1.0, 1.0])
  out = losses.clipped_pg_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
  np.testing.assert_allclose(out, [[0, -1.2], [0, 0.8], [0, 3.0], [0, -1.1]], rtol=1e-6)
  grad = jax.grad(lambda lp: losses.clipped_pg_loss(lp, old, adv, mask, 0.2, 0.2, 3.0).sum())(logp)
  np.testing.assert_allclose(grad[:, 1], [0.0, 0.0, 0.0, -1.1], rtol=1e-6)  # clipped tokens stop pushing
  d = diagnostics.pg_diagnostics(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
  # clip/low: A<0, r<0.8 (row 1); clip/high: A>0, r>1.2 (row 0); dual: A<0, r>3 (row 2). 4 tokens.
  assert [float(d[k]) for k in ("clip/low/sum", "clip/high/sum", "clip/dual/sum", "ratio/mean/count")] == [1, 1, 1, 4]
  np.testing.assert_allclose([d["ratio/mean/sum"], d["ratio/min"], d["ratio/max"]], [8.1, 0.5, 5.0], rtol=1e-6)


def test_aggregate_hand_values_and_safe_ratio():
  v = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
  m = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
  np.testing.assert_allclose(losses.aggregate(v, m, "seq-mean-token-mean"), (2.0 + 4.0, 2.0))
  np.testing.assert_allclose(losses.aggregate(v, m, "token-mean"), (10.0, 4.0))
  np.testing.assert_allclose(losses.aggregate(v, m, "seq-mean-token-sum"), (10.0, 2.0))
  assert float(losses.ratio(jnp.float32(0.0), jnp.float32(0.0))) == 0.0
  assert float(losses.ratio(jnp.float32(3.0), jnp.float32(2.0))) == 1.5
  with pytest.raises(ValueError, match="aggregation"):
    losses.aggregate(v, m, "seq-sum")


def _random_batch(rng, N=8, S=12):
  """Right-padded rows: prompt [0, p), response [p, p + r); row 1 has no scored prompt, row 2 no response."""
  p = rng.integers(2, 6, N)
  r = rng.integers(1, S - 6, N)
  p[1], r[2] = 1, 0
  t = np.arange(S)
  prompt = t[None] < p[:, None]
  response = (t[None] >= p[:, None]) & (t[None] < (p + r)[:, None])
  logp = rng.normal(-2.0, 1.0, (N, S))
  return dict(logp=logp, old=logp + rng.normal(0, 0.3, (N, S)), ref=logp + rng.normal(0, 0.5, (N, S)),
              prompt=prompt, response=response, adv=rng.normal(size=N), w=rng.uniform(0, 2, N),
              ent=rng.uniform(0, 3, (N, S)))


def _np_agg(row_sums, row_counts, mode):
  """Float64 reference of one aggregation mode, row by row."""
  rows = [i for i in range(len(row_sums)) if row_counts[i] > 0]
  if mode in ("seq-mean-token-mean", "row-mean"):
    return sum(row_sums[i] / row_counts[i] for i in rows) / max(len(rows), 1)
  if mode == "token-mean":
    return sum(row_sums) / max(sum(row_counts), 1)
  return sum(row_sums[i] for i in rows) / max(len(rows), 1)


def _np_erpo_loss(b, *, alpha, kl_on, estimator, kl_aggregation, loss_aggregation, dual_clip, entropy_coef):
  """Independent float64 reimplementation of SPEC sections 1, 4 and 5."""
  N, S = b["logp"].shape
  k = {"k1": lambda d: d, "k2": lambda d: d * d / 2, "k3": lambda d: math.exp(-d) + d - 1}[estimator]
  pg_s, pg_c, kl_s, kl_c, ent_s = [], [], [], [], []
  for i in range(N):
    resp = [t for t in range(1, S) if b["response"][i, t]]
    prom = [t for t in range(1, S) if b["prompt"][i, t]]
    pen = {"prompt": prom, "response": resp, "all": sorted(prom + resp), "none": []}[kl_on]
    a, total = b["adv"][i], 0.0
    for t in resp:
      r = math.exp(min(max(b["logp"][i, t] - b["old"][i, t], -20), 20))
      lt = max(-a * r, -a * min(max(r, 0.8), 1.28))
      if dual_clip is not None and a < 0:
        lt = min(lt, -a * dual_clip)
      total += b["w"][i] * lt
    pg_s.append(total)
    pg_c.append(len(resp))
    kl_s.append(sum(min(k(min(max(b["logp"][i, t] - b["ref"][i, t], -20), 20)), 10.0) for t in pen))
    kl_c.append(len(pen))
    ent_s.append(sum(b["ent"][i, t] for t in resp))
  return (_np_agg(pg_s, pg_c, loss_aggregation) + alpha * _np_agg(kl_s, kl_c, kl_aggregation)
          - entropy_coef * _np_agg(ent_s, pg_c, loss_aggregation))


def _loss(b, **kw):
  return losses.erpo_loss(b["logp"], b["old"], b["ref"], b["prompt"], b["response"], b["adv"], b["w"],
                          entropy_NxS=b["ent"], eps_low=0.2, eps_high=0.28, **kw)


@pytest.mark.parametrize("loss_aggregation", MODES)
@pytest.mark.parametrize("kl_on,kl_aggregation,estimator,dual_clip", [
    ("prompt", "row-mean", "k3", None), ("response", "token-mean", "k1", 3.0),
    ("all", "row-mean", "k2", None), ("none", "token-mean", "k3", 2.0)])
def test_erpo_loss_matches_numpy_float64_reference(loss_aggregation, kl_on, kl_aggregation, estimator, dual_clip):
  kw = dict(alpha=0.3, kl_on=kl_on, estimator=estimator, kl_aggregation=kl_aggregation,
            loss_aggregation=loss_aggregation, dual_clip=dual_clip, entropy_coef=0.01)
  for seed in range(3):
    b = _random_batch(np.random.default_rng(seed))
    with jax.enable_x64(True):
      loss, _ = _loss({k: jnp.asarray(v) for k, v in b.items()}, **kw)
      np.testing.assert_allclose(float(loss), _np_erpo_loss(b, **kw), rtol=1e-6, atol=1e-6)
    loss32, _ = _loss({k: np.asarray(v, np.float32) if v.dtype != bool else v for k, v in b.items()}, **kw)
    np.testing.assert_allclose(float(loss32), _np_erpo_loss(b, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_over_minibatches_with_whole_batch_counts_equals_whole_batch(mode):
  rng = np.random.default_rng(4)
  v = jnp.asarray(rng.normal(size=(12, 7)), jnp.float32)
  m = jnp.asarray(rng.random((12, 7)) > 0.4).at[3].set(False)
  total, count = losses.aggregate(v, m, mode)
  for k in (2, 3, 4):
    parts = [losses.aggregate(v[i:i + 12 // k], m[i:i + 12 // k], mode) for i in range(0, 12, 12 // k)]
    np.testing.assert_allclose(sum(p[0] for p in parts) / sum(p[1] for p in parts), total / count, rtol=1e-6)
    np.testing.assert_allclose(sum(losses.ratio(p[0], count) for p in parts), total / count, rtol=1e-5)


@pytest.mark.parametrize("loss_aggregation", MODES)
@pytest.mark.parametrize("kl_aggregation", ["row-mean", "token-mean"])
def test_minibatch_losses_and_grads_add_up_to_whole_batch(loss_aggregation, kl_aggregation):
  b = {k: jnp.asarray(v, jnp.float32) if v.dtype != bool else jnp.asarray(v)
       for k, v in _random_batch(np.random.default_rng(5)).items()}
  kw = dict(alpha=0.5, kl_on="all", loss_aggregation=loss_aggregation, kl_aggregation=kl_aggregation,
            entropy_coef=0.1)
  den = losses.global_denominators(b["prompt"], b["response"], kl_on="all", loss_aggregation=loss_aggregation,
                                   kl_aggregation=kl_aggregation)

  def f(logp, rows, denominators):
    return _loss(dict({k: v[rows] for k, v in b.items()}, logp=logp), denominators=denominators, **kw)

  (whole, m_whole), g_whole = jax.value_and_grad(f, has_aux=True)(b["logp"], slice(None), None)
  parts = [jax.value_and_grad(f, has_aux=True)(b["logp"][i:i + 2], slice(i, i + 2), den) for i in range(0, 8, 2)]
  np.testing.assert_allclose(sum(p[0][0] for p in parts), whole, rtol=1e-5)
  np.testing.assert_allclose(jnp.concatenate([p[1] for p in parts]), g_whole, rtol=1e-4, atol=1e-7)
  combined = diagnostics.finalize_metrics(diagnostics.combine_metrics([p[0][1] for p in parts]))
  for name, value in diagnostics.finalize_metrics(m_whole).items():
    np.testing.assert_allclose(combined[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_padding_changes_nothing_including_gradients():
  b = {k: np.asarray(v, np.float32) if v.dtype != bool else v
       for k, v in _random_batch(np.random.default_rng(6)).items()}
  junk = {k: v.copy() for k, v in b.items()}
  scored = b["prompt"] | b["response"]
  for key in ("logp", "old", "ref", "ent"):
    junk[key][~scored] = np.nan
    junk[key][:, 0] = np.inf  # column 0 carries no log-prob
  junk["w"][2], junk["adv"][2] = np.nan, np.inf  # row 2 has no response tokens
  junk = {k: jnp.asarray(v) for k, v in junk.items()}

  def f(logp, batch):
    return _loss(dict(batch, logp=logp), alpha=0.2, kl_on="all", entropy_coef=0.1)

  (loss, m), g = jax.value_and_grad(f, has_aux=True)(b["logp"], b)
  (junk_loss, junk_m), junk_g = jax.value_and_grad(f, has_aux=True)(junk["logp"], junk)
  np.testing.assert_array_equal(junk_loss, loss)
  np.testing.assert_array_equal(junk_g, g)
  for key, value in m.items():
    np.testing.assert_array_equal(junk_m[key], value, err_msg=key)


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy():
  logp, ref, prompt, response = _worked_example()
  ent = np.array([[0.0, 0.0, 1.0], [0.0, 0.0, 3.0]], np.float32)
  base, _ = losses.erpo_loss(logp, None, ref, prompt, response, jnp.ones(2), entropy_NxS=ent, entropy_coef=0.0)
  bonus, m = losses.erpo_loss(logp, None, ref, prompt, response, jnp.ones(2), entropy_NxS=ent, entropy_coef=0.1)
  np.testing.assert_allclose(base - bonus, 0.1 * 2.0, rtol=1e-5)
  np.testing.assert_allclose(diagnostics.finalize_metrics(m)["entropy/mean"], 2.0)


def test_erpo_loss_under_jit_matches_eager():
  b = {k: np.asarray(v, np.float32) if v.dtype != bool else v
       for k, v in _random_batch(np.random.default_rng(7)).items()}
  static = ("kl_on", "estimator", "kl_aggregation", "loss_aggregation", "dual_clip")
  kw = dict(alpha=0.1, kl_on="prompt", estimator="k3", kl_aggregation="row-mean",
            loss_aggregation="token-mean", dual_clip=3.0)
  args = (b["logp"], b["old"], b["ref"], b["prompt"], b["response"], b["adv"], b["w"])
  jitted, eager = jax.jit(losses.erpo_loss, static_argnames=static)(*args, **kw), losses.erpo_loss(*args, **kw)
  np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
  assert jitted[1].keys() == eager[1].keys()
  for key in eager[1]:
    np.testing.assert_allclose(jitted[1][key], eager[1][key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("kl_on", ["prompt", "response", "all", "none"])
def test_penalises_prompt_says_whether_the_kl_mask_covers_a_prompt_token(kl_on):
  prompt_NxS = np.array([[True, True, True, False, False]])
  response_NxS = np.array([[False, False, False, True, True]])
  covered = np.asarray(losses.kl_mask(prompt_NxS, response_NxS, kl_on))
  assert losses.penalises_prompt(kl_on) == bool((covered & prompt_NxS).any())
  assert covered.any() == (kl_on != "none")  # the masks are real: a penalty covers some token

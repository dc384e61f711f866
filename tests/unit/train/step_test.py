"""The jitted update: compiles once, equals losses.erpo_loss, and sharded == unsharded."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from erpo_jax.algo import advantages, kl, losses, weights
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import multihost
from erpo_jax.train import optim
from erpo_jax.train import step as train_step
from erpo_jax.config_io import load_config
from erpo_jax.model import llama, logprobs

B, G, S, V = 2, 4, 24, 128


def tiny_cfg(*overrides):
  base = ["model.path=random", f"model.random_init.vocab_size={V}", "model.random_init.hidden_size=32",
          "model.random_init.num_layers=2", "model.random_init.num_heads=4", "model.random_init.num_kv_heads=2",
          "model.random_init.head_dim=8", "model.random_init.intermediate_size=64", f"data.batch_size={B}",
          f"rollout.group_size={G}", "optim.lr=1e-2", "model.logits_chunk=40", "erpo.reference=forward"]
  return load_config(None, base + list(overrides))


def make_batch(seed=0, n=B * G, s=S):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (n, s)).astype(np.int32)
  prompt_len = rng.integers(3, 9, n // G).repeat(G)
  resp_len = rng.integers(1, s - 9, n)
  pos = np.arange(s)[None]
  prompt_mask = pos < prompt_len[:, None]
  response_mask = (pos >= prompt_len[:, None]) & (pos < (prompt_len + resp_len)[:, None])
  for i in range(0, n, G):  # the G rows of a prompt share it
    tokens[i + 1:i + G, :prompt_len[i]] = tokens[i, :prompt_len[i]]
  tokens = np.where(prompt_mask | response_mask, tokens, 0)
  return train_step.UpdateBatch(
      tokens=jnp.asarray(tokens), prompt_mask=jnp.asarray(prompt_mask), query_mask=jnp.asarray(prompt_mask),
      response_mask=jnp.asarray(response_mask),
      rewards=jnp.asarray(rng.integers(0, 2, n).astype(np.float32)),
      ref_logp=jnp.asarray(np.where(prompt_mask, -rng.random((n, s)) * 5, 0).astype(np.float32)),
      static_weight=jnp.asarray(rng.uniform(0.5, 2.0, n).astype(np.float32)),
      truncated=jnp.asarray(np.arange(n) % 3 == 1),  # flags only: ppo.mask_truncated decides what they do
      policy_kl=jnp.asarray(True))  # a cached step given reference params runs their forward


def build(cfg, devices=None, model_seed=0, with_reference=None):
  """(step, graphdef, params, ref_params, opt_state); with_reference: the step takes reference params
  (default: when erpo.reference=forward; a cached step given them logs the Policy-KL)."""
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=devices)
  mc = llama.model_config_from_random_init(cfg.model.random_init)
  model = llama.init_random(mc, seed=model_seed)
  ref = llama.init_random(mc, seed=model_seed + 1)
  mesh_lib.shard_model(model, mesh)
  mesh_lib.shard_model(ref, mesh)
  graphdef, params = nnx.split(model)
  _, ref_params = nnx.split(ref)
  psh = mesh_lib.param_shardings(params, mesh)
  tx, schedule = optim.make_optimizer(cfg.optim, cfg.train.steps, cfg.ppo.minibatches * cfg.ppo.epochs)
  osh = optim.opt_state_shardings(tx, params, psh, mesh)
  opt_state = optim.init_opt_state(tx, params, osh)
  step = train_step.build_train_step(graphdef, tx, schedule, cfg, mesh=mesh, param_shardings=psh,
                                     opt_shardings=osh,
                                     ref_shardings=psh if (cfg.erpo.reference == "forward" if with_reference is None
                                                           else with_reference) else None)
  return step, graphdef, params, ref_params, opt_state


def expected_loss(cfg, graphdef, params, ref_params, batch):
  """losses.erpo_loss on separately computed log-probs."""
  model = nnx.merge(graphdef, params)
  logp = logprobs.log_probs(model, batch.tokens)
  ref = logprobs.log_probs(nnx.merge(graphdef, ref_params), batch.tokens)
  adv = advantages.group_advantages(batch.rewards, G, estimator=cfg.ppo.advantage)
  w = {"static": batch.static_weight, "none": jnp.ones(B * G)}.get(cfg.erpo.weights)
  if cfg.erpo.weights == "dynamic":
    w = weights.dynamic_weights(*weights.prompt_nll(logp, batch.prompt_mask))
  loss, _ = losses.erpo_loss(logp, logp, ref, batch.prompt_mask, batch.response_mask, adv, w,
                             alpha=cfg.erpo.alpha, kl_on=cfg.erpo.kl_on)
  return float(loss)


@pytest.mark.parametrize("weights,kl_on,advantage", [
    ("static", "prompt", "grpo"), ("dynamic", "prompt", "grpo"), ("none", "response", "grpo"), ("static", "all", "grpo"),
    ("dynamic", "prompt", "rloo")])
def test_step_loss_equals_erpo_loss_on_separate_log_probs(weights, kl_on, advantage):
  cfg = tiny_cfg(f"erpo.weights={weights}", f"erpo.kl_on={kl_on}", "erpo.reference=forward", "erpo.alpha=0.5",
                 f"ppo.advantage={advantage}")
  step, graphdef, params, ref_params, opt_state = build(cfg)
  batch = make_batch()
  want = expected_loss(cfg, graphdef, params, ref_params, batch)
  _, _, metrics = step(params, opt_state, ref_params, batch)
  # float32, summed in another order (shared prefix, packing); the prompt k3 terms, exp(ref - logp) with
  # ref down to -5, scale a log-prob's rounding up to ~150x: CPUs differ by ~1e-6 relative (AVX2 vs AVX-512).
  assert float(metrics["loss/total"]) == pytest.approx(want, rel=1e-5, abs=1e-6)
  assert float(metrics["optim/finite"]) == 1.0


@pytest.mark.parametrize("advantage", ["grpo", pytest.param("rloo", marks=pytest.mark.slow),
                                       pytest.param("reinforce", marks=pytest.mark.slow)])
def test_step_compiles_once_for_a_fixed_bucket(advantage):
  cfg = tiny_cfg(f"ppo.advantage={advantage}")
  step, graphdef, params, ref_params, opt_state = build(cfg)
  for seed in range(3):
    params, opt_state, metrics = step(params, opt_state, ref_params, make_batch(seed))
  assert step._cache_size() == 1
  step(params, opt_state, ref_params, make_batch(0, s=S + 8))
  assert step._cache_size() == 2


def test_step_updates_params_and_logs_every_spec_scalar():
  cfg = tiny_cfg()
  step, graphdef, params, ref_params, opt_state = build(cfg)
  before = jax.tree.map(np.array, params)
  params, opt_state, metrics = step(params, opt_state, ref_params, make_batch())
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, params)
  assert all(jax.tree.leaves(changed))
  for name in ["kl/query", "kl/policy", "loss/pg", "loss/kl", "loss/total", "clip/low", "clip/high", "clip/dual",
               "ratio/mean", "ratio/min", "ratio/max", "weight/mean", "weight/min", "weight/max",
               "prompt_nll/mean", "prompt_nll/min", "prompt_nll/max", "entropy/mean", "optim/grad_norm",
               "optim/lr", "reward/zero_std_groups", "kl/clamped_frac"]:
    assert name in metrics and np.isfinite(float(metrics[name])), name


def test_static_weights_scale_the_task_term_and_not_the_penalty():
  batch = make_batch()
  doubled = batch.replace(static_weight=jnp.full((B * G,), 2.0))
  step, _, params, ref, opt = build(tiny_cfg("erpo.weights=static", "erpo.alpha=1.0"))
  _, _, k_w = step(params, opt, ref, doubled)
  step, _, params, ref, opt = build(tiny_cfg("erpo.weights=none", "erpo.alpha=1.0"))
  _, _, k_1 = step(params, opt, ref, batch)
  assert abs(float(k_w["loss/pg"]) - 2 * float(k_1["loss/pg"])) < 1e-6
  # The penalty is never weighted: same kl with any weights.
  assert abs(float(k_w["loss/kl"]) - float(k_1["loss/kl"])) < 1e-7
  assert abs(float(k_w["loss/total"]) - (2 * float(k_1["loss/pg"]) + float(k_1["loss/kl"]))) < 1e-6


def test_kl_on_prompt_penalises_query_kl_and_response_penalises_policy_kl():
  batch = make_batch()
  out = {}
  for kl_on in ("prompt", "response", "none"):
    step, _, params, ref, opt = build(tiny_cfg(f"erpo.kl_on={kl_on}", "erpo.alpha=1.0", "erpo.weights=none"))
    out[kl_on] = {k: float(v) for k, v in step(params, opt, ref, batch)[2].items()}
  # Both KLs are logged whichever is penalised, and agree across modes.
  assert out["prompt"]["kl/query"] == pytest.approx(out["response"]["kl/query"], abs=1e-7)
  assert out["prompt"]["kl/policy"] == pytest.approx(out["response"]["kl/policy"], abs=1e-7)
  assert out["prompt"]["loss/kl"] == pytest.approx(out["prompt"]["kl/query"], abs=1e-6)
  assert out["response"]["loss/kl"] == pytest.approx(out["response"]["kl/policy"], abs=1e-6)
  assert out["none"]["loss/total"] == pytest.approx(out["none"]["loss/pg"], abs=1e-7)


def test_cached_reference_needs_no_reference_params():
  cfg = tiny_cfg("erpo.reference=cached", "erpo.kl_on=prompt", "erpo.alpha=1.0")
  step, graphdef, params, _, opt = build(cfg)
  batch = make_batch()
  logp = logprobs.log_probs(nnx.merge(graphdef, params), batch.tokens)
  want = kl.row_kl(logp, batch.ref_logp, batch.prompt_mask).per_row_N.mean()
  _, _, m = step(params, opt, None, batch)  # params are donated: compute the expectation first
  assert float(m["loss/kl"]) == pytest.approx(float(want), abs=1e-6)


def test_minibatches_get_their_dynamic_weights_from_the_whole_batch():
  batch = make_batch()
  one = tiny_cfg("erpo.weights=dynamic", "ppo.minibatches=1", "ppo.epochs=2")
  two = tiny_cfg("erpo.weights=dynamic", "ppo.minibatches=2", "ppo.epochs=1")
  step1, _, p1, r1, o1 = build(one)
  step2, _, p2, r2, o2 = build(two)
  m1 = step1(p1, o1, r1, batch)[2]
  m2 = step2(p2, o2, r2, batch)[2]
  # Weights come from the pre-update forward over the whole batch in both layouts.
  assert float(m1["weight/mean"]) == pytest.approx(float(m2["weight/mean"]), abs=1e-6)
  assert np.isfinite(float(m2["loss/total"]))


def test_a_truncated_row_under_mask_truncated_gives_the_step_of_its_response_mask_cleared():
  batch = make_batch()
  flagged = batch.replace(truncated=jnp.asarray(np.arange(B * G) == 2))
  cleared = batch.replace(truncated=jnp.zeros(B * G, bool), response_mask=batch.response_mask.at[2].set(False))
  out = {}
  for name, b in (("flagged", flagged), ("cleared", cleared)):
    # kl_on=all: the response KL and its token count leave out row 2 too.
    cfg = tiny_cfg("ppo.mask_truncated=true", "erpo.kl_on=all", "erpo.alpha=0.5", "erpo.weights=static",
                   "ppo.loss_aggregation=token-mean", "ppo.eps_high=0.28", "optim.eps=1e-3")
    step, _, params, ref, opt = build(cfg)
    new_params, _, m = step(params, opt, ref, b)
    out[name] = ({k: float(v) for k, v in m.items()}, [np.asarray(x) for x in jax.tree.leaves(new_params)])
  assert out["flagged"][0]["loss/masked_truncated"] == pytest.approx(1 / 8)
  assert out["cleared"][0]["loss/masked_truncated"] == 0.0
  for key in ("loss/total", "loss/pg", "loss/kl", "entropy/mean", "clip/low", "clip/high", "ratio/mean",
              "optim/grad_norm"):
    assert out["flagged"][0][key] == pytest.approx(out["cleared"][0][key], rel=1e-6, abs=1e-7), key
  assert abs(out["flagged"][0]["loss/kl"]) > 1e-4  # the response KL is in the loss and row 2's is not
  for a, b in zip(out["flagged"][1], out["cleared"][1]):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


# name -> (overrides, mesh shapes (data, fsdp, tensor)); each setting's sharded steps are compared with its (1, 1, 1).
SHARDED_SETTINGS = {
    "grpo": ([], [(1, 1, 1), (8, 1, 1), (2, 2, 2)]),
    # RLOO advantages with DAPO's settings and dynamic weights: rows 1, 4, 7 of make_batch are truncated and
    # left out of the loss.
    "rloo_dapo": (["ppo.advantage=rloo", "erpo.weights=dynamic", "ppo.mask_truncated=true", "ppo.eps_high=0.28",
                   "ppo.loss_aggregation=token-mean", "erpo.kl_on=all"], [(1, 1, 1), (2, 2, 2)]),
}

# Meshes of the packed-responses comparison (B = 4 groups): one stream; one per batch shard (2, 4 and 2 shards);
# 8 batch shards cannot hold whole groups, so that mesh runs unpacked.
PACKED_SHAPES = {(1, 1, 1): 1, (2, 1, 1): 2, (2, 2, 2): 4, (1, 2, 2): 2, (8, 1, 1): 0}

SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    import step_test as t
    from erpo_jax.model import logprobs
    from erpo_jax.parallel import mesh as mesh_lib
    from erpo_jax.train import batch as batch_lib, packing
    out = {{}}
    batch = t.make_batch()
    meshes, packed_meshes = ([tuple(m) for m in json.loads(a)] for a in sys.argv[1:3])
    for name, (overrides, shapes) in t.SHARDED_SETTINGS.items():
      for shape in [s for s in shapes if s in meshes]:
        d, f, tp = shape
        cfg = t.tiny_cfg(f"mesh.data={{d}}", f"mesh.fsdp={{f}}", f"mesh.tensor={{tp}}", *overrides)
        devices = jax.devices()[:d * f * tp]
        step, _, params, ref, opt = t.build(cfg, devices=devices)
        params, opt, m = step(params, opt, ref, batch)
        out[f"{{name}} {{shape}}"] = {{"metrics": {{k: float(v) for k, v in m.items()}},
                                    "params": [np.asarray(x).ravel()[:50].tolist() for x in jax.tree.leaves(params)]}}
    # Packed responses, one stream per batch shard (as many as whole groups allow), each stream's own capacity.
    packed_caps = ["data.max_prompt_tokens=8", "rollout.max_new_tokens=16", "erpo.kl_on=all", "erpo.alpha=0.5",
                   "data.batch_size=4"]
    batch = t.make_batch(n=4 * t.G)
    resp_len = np.minimum(np.asarray(batch.response_mask).sum(axis=1), 16)
    for shape in [s for s in t.PACKED_SHAPES if s in packed_meshes]:
      d, f, tp = shape
      cfg = t.tiny_cfg(f"mesh.data={{d}}", f"mesh.fsdp={{f}}", f"mesh.tensor={{tp}}", *packed_caps)
      devices = jax.devices()[:d * f * tp]
      step, _, params, ref, opt = t.build(cfg, devices=devices)
      mesh = mesh_lib.make_mesh(cfg.mesh, devices=devices)
      streams = logprobs.packed_streams(4, mesh_lib.num_batch_shards(mesh))
      cap = int(resp_len.reshape(streams, -1).sum(axis=1).max()) if streams else None
      params, opt, m = step(params, opt, ref, batch, None, cap)
      out[f"packed {{shape}}"] = {{"streams": streams, "capacity": cap,
                                 "metrics": {{k: float(v) for k, v in m.items()}},
                                 "params": [np.asarray(x).ravel()[:50].tolist() for x in jax.tree.leaves(params)]}}
      # The capacity the loop computes: 4 groups of 8 rows of up to 64 tokens, rows 0-15 of 40, 16-31 of 10.
      big = t.tiny_cfg(f"mesh.data={{d}}", f"mesh.fsdp={{f}}", f"mesh.tensor={{tp}}", "data.batch_size=4",
                       "rollout.group_size=8", "rollout.max_new_tokens=64")
      lens = np.array([40] * 16 + [10] * 16)
      host = batch_lib.HostRollout(tokens=None, prompt_mask=None, response_mask=None, prompt_len=None,
                                   response_len=lens, truncated=None)
      out[f"packed {{shape}}"]["loop_capacity"] = packing.response_capacity(big, host, mesh)
    print(json.dumps(out))
""")


def test_sharded_step_equals_one_device_on_8_cpu_devices():
  # The most general mesh (data x fsdp x tensor) for every setting; packed, also 8 batch shards, which cannot
  # pack whole groups. The slow sibling runs every mesh.
  _check_sharded_steps([(1, 1, 1), (2, 2, 2)], [(1, 1, 1), (2, 2, 2), (8, 1, 1)])


@pytest.mark.slow
def test_sharded_step_equals_one_device_on_every_mesh():
  _check_sharded_steps(sorted({s for _, ss in SHARDED_SETTINGS.values() for s in ss}), list(PACKED_SHAPES))


def _check_sharded_steps(meshes, packed_meshes):
  """The step on each of `meshes` (8 CPU devices; (1, 1, 1) first) equals the one-device step for every setting
  of SHARDED_SETTINGS that lists the mesh, and the packed step on each of `packed_meshes` equals its one-device
  step."""
  env = multihost.cpu_device_env(os.environ, 8)
  code = SHARDED_SCRIPT.format(tests=os.path.dirname(__file__))
  res = subprocess.run([sys.executable, "-c", code, json.dumps(meshes), json.dumps(packed_meshes)], env=env,
                       capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  assert out["rloo_dapo (1, 1, 1)"]["metrics"]["loss/masked_truncated"] == pytest.approx(3 / 8)
  compared = 0
  for name, (_, shapes) in SHARDED_SETTINGS.items():
    base = out[f"{name} (1, 1, 1)"]
    for shape in [s for s in shapes[1:] if s in meshes]:
      compared += 1
      got = out[f"{name} {shape}"]
      for k, v in base["metrics"].items():
        assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), (name, shape, k)
      for a, b in zip(base["params"], got["params"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
  # Packed responses: one stream on one device, one per batch shard on the meshes, the same update.
  base = out["packed (1, 1, 1)"]
  assert base["capacity"] < 4 * G * 16
  # The loop's capacity (buckets.packed_capacity, multiples of 128 here): one stream of 800 tokens -> 896 slots;
  # two streams of 640 and 160 -> 640 each; four of 320, 320, 80, 80 -> 384 each; none on 8 shards.
  loop_capacity = {(1, 1, 1): 896, (2, 1, 1): 640, (2, 2, 2): 384, (1, 2, 2): 640, (8, 1, 1): None}
  for shape, streams in PACKED_SHAPES.items():
    if shape not in packed_meshes:
      continue
    compared += shape != (1, 1, 1)
    got = out[f"packed {shape}"]
    assert got["streams"] == streams and got["loop_capacity"] == loop_capacity[shape], shape
    if shape == (1, 1, 1):
      continue
    if streams == 0:
      assert got["capacity"] is None, shape
    else:  # fewer slots than one stream of the batch, and than the stream's own [N / streams, R] rows: packed
      assert got["capacity"] < base["capacity"] and got["capacity"] < (4 * G // streams) * 16, shape
    for k, v in base["metrics"].items():
      assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), (shape, k)
    for a, b in zip(base["params"], got["params"]):
      np.testing.assert_allclose(a, b, atol=1e-5)
  assert compared >= len(SHARDED_SETTINGS) + len(packed_meshes) - 1, compared  # each setting and packed mesh


@pytest.mark.slow
def test_shared_prefix_step_equals_the_plain_layout():
  # Caps P=8, R=16 make [B,P] + [N,R] smaller than [N,S], so the shared-prefix forward runs.
  caps = ["data.max_prompt_tokens=8", "rollout.max_new_tokens=16", "optim.lr=1e-6"]
  batch = make_batch()
  out = {}
  for shared in (True, False):
    step, _, params, ref, opt = build(tiny_cfg(*caps, f"model.shared_prefix={str(shared).lower()}",
                                               "erpo.kl_on=all", "erpo.alpha=0.5"))
    out[shared] = {k: float(v) for k, v in step(params, opt, ref, batch)[2].items()}
  for key, value in out[False].items():
    assert out[True][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_packed_responses_step_equals_the_unpacked_step():
  caps = ["data.max_prompt_tokens=8", "rollout.max_new_tokens=16", "optim.lr=1e-3", "erpo.kl_on=all",
          "erpo.alpha=0.5", "erpo.weights=dynamic"]
  batch = make_batch()
  R = 16
  response_tokens = int(np.minimum(np.asarray(batch.response_mask).sum(axis=1), R).sum())
  capacity = response_tokens + 3
  assert capacity < B * G * R  # fewer slots than the unpacked response rows: the packed forward runs
  out = {}
  for cap in (None, capacity):
    step, _, params, ref, opt = build(tiny_cfg(*caps))
    new_params, _, metrics = step(params, opt, ref, batch, None, cap)
    out[cap] = ({k: float(v) for k, v in metrics.items()}, [np.asarray(x) for x in jax.tree.leaves(new_params)])
  for key, value in out[None][0].items():
    assert out[capacity][0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
  for a, b in zip(out[None][1], out[capacity][1]):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert abs(out[None][0]["loss/total"]) > 1e-3

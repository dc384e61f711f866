"""Uniform groups forward-only (model.forward_only_uniform_groups): the same update and metrics as when every
response runs backward, on one device and on sharded meshes; where it applies and what capacity it takes."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import multihost
from erpo_jax.train import batch as batch_lib
from erpo_jax.train import packing
from erpo_jax.train.packing import SplitCapacity

sys.path.insert(0, os.path.dirname(__file__))
import step_test as t  # noqa: E402  (the step tests' tiny model, batch and builder)

R = 16
CAPS = ["data.max_prompt_tokens=8", f"rollout.max_new_tokens={R}", "optim.lr=1e-3", "erpo.alpha=0.5",
        "erpo.reference=cached"]


def uniform_batch(groups, uniform_groups, seed=0):
  """make_batch with `groups` groups; the groups in `uniform_groups` get equal rewards (0.1: not a binary one)."""
  batch = t.make_batch(seed=seed, n=groups * t.G)
  rewards = np.tile(np.array([0.0, 1.0, 1.0, 0.0], np.float32), groups)
  for b in uniform_groups:
    rewards[b * t.G:(b + 1) * t.G] = 0.1
  return batch.replace(rewards=jnp.asarray(rewards))


def capacities(batch, uniform_groups, streams=1):
  """(whole, trained, forward-only) slots: each stream's response tokens, exactly."""
  len_N = np.minimum(np.asarray(batch.response_mask).sum(axis=1), R)
  uniform_N = np.repeat(np.isin(np.arange(len(len_N) // t.G), uniform_groups), t.G)
  most = lambda x: int(x.reshape(streams, -1).sum(axis=1).max())
  return SplitCapacity(most(len_N), most(np.where(uniform_N, 0, len_N)), most(np.where(uniform_N, len_N, 0)))


def run(cfg, batch, capacity):
  step, _, params, ref, opt = t.build(cfg, with_reference=True)
  new_params, _, metrics = step(params, opt, ref, batch, None, capacity)
  return {k: float(v) for k, v in metrics.items()}, [np.asarray(x) for x in jax.tree.leaves(new_params)]


@pytest.mark.parametrize("overrides", [["erpo.kl_on=prompt", "erpo.weights=static"],
                                       ["erpo.kl_on=prompt", "erpo.weights=dynamic", "ppo.mask_truncated=true"],
                                       ["erpo.kl_on=none", "ppo.advantage=rloo", "ppo.loss_aggregation=token-mean"]])
def test_uniform_groups_forward_only_give_the_update_and_metrics_of_the_whole_backward(overrides):
  cfg = t.tiny_cfg(*CAPS, *overrides)
  batch = uniform_batch(2, [0])  # group 0's rewards are equal, group 1's are not
  split = capacities(batch, [0])
  assert 0 < split.trained < split.whole and 0 < split.forward_only < split.whole
  whole_metrics, whole_params = run(cfg, batch, split.whole)
  split_metrics, split_params = run(cfg, batch, split)
  assert set(split_metrics) == set(whole_metrics)
  for key, value in whole_metrics.items():
    assert split_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
  assert_same_update(cfg, whole_params, split_params)
  # The metrics that read the uniform group's responses are there and not trivially zero.
  assert whole_metrics["entropy/mean"] > 0.1 and whole_metrics["kl/policy"] > 0
  assert whole_metrics["reward/zero_std_groups"] == 0.5


def assert_same_update(cfg, whole_params, split_params, moved=0.5):
  """The two updates agree to 2% of the learning rate, and the update moved a parameter by `moved` * lr.

  Adam's first step moves each parameter by lr * g / (|g| + eps): for gradients near eps (those the
  response penalty's absence leaves tiny) the rounding of sums taken in another order shows at about 1% of lr.
  """
  lr = cfg.optim.lr
  before = [np.asarray(x) for x in jax.tree.leaves(t.build(cfg)[2])]
  for a, b in zip(whole_params, split_params):
    np.testing.assert_allclose(b, a, atol=0.02 * lr)
  assert max(np.abs(a - b).max() for a, b in zip(whole_params, before)) > moved * lr


def test_uniform_rows_past_the_forward_only_capacity_run_in_the_trained_stream_with_the_same_update():
  cfg = t.tiny_cfg(*CAPS, "erpo.kl_on=prompt")
  batch = uniform_batch(2, [0])
  len_N = np.minimum(np.asarray(batch.response_mask).sum(axis=1), R)
  whole, trained, _ = capacities(batch, [0])
  split = SplitCapacity(whole, trained + int(len_N[2:4].sum()), int(len_N[:2].sum()))  # rows 2, 3 do not fit
  rows = packing.forward_only_rows(np.asarray(batch.rewards), len_N, t.G, 1, split.forward_only)
  assert rows.tolist() == [True, True] + [False] * 6
  whole_metrics, whole_params = run(cfg, batch, whole)
  split_metrics, split_params = run(cfg, batch, split)
  for key, value in whole_metrics.items():
    assert split_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
  assert_same_update(cfg, whole_params, split_params)


@pytest.mark.parametrize("streams", [1, 2, 4])
def test_the_split_capacities_always_hold_every_response(streams):
  rng = np.random.default_rng(streams)
  G, R, split_seen = 8, 64, set()
  for _ in range(300):
    B = 4 * streams
    len_N = rng.integers(1, R + 1, B * G)
    if rng.random() < 0.5:
      len_N = np.minimum(len_N, rng.integers(1, R + 1))
    rewards_N = np.repeat(rng.random(B) < rng.random(), G).astype(np.float32)  # some groups all 1 or all 0
    rewards_N[rng.random(B * G) < 0.1] = 0.5  # some groups mixed
    cap = packing.capacity_of(len_N, rewards_N, G, streams, R)
    whole = packing.capacity_of(len_N, None, G, streams, R)
    assert whole >= len_N.reshape(streams, -1).sum(axis=1).max()
    if not isinstance(cap, SplitCapacity):
      assert cap == whole
      continue
    split_seen.add(whole // cap.trained)
    fwd_N = packing.forward_only_rows(rewards_N, len_N, G, streams, cap.forward_only)
    r_BxG = rewards_N.reshape(-1, G)
    assert not np.any(fwd_N & ~np.repeat(np.all(r_BxG == r_BxG[:, :1], axis=1), G))  # only uniform rows
    per_stream = lambda x_N: x_N.reshape(streams, -1).sum(axis=1)
    assert per_stream(np.where(fwd_N, len_N, 0)).max() <= cap.forward_only
    assert per_stream(np.where(fwd_N, 0, len_N)).max() <= cap.trained
    assert cap.whole == whole and cap.trained in (whole // 4, whole // 2)
  assert split_seen == {4, 2}


def test_every_group_uniform_still_penalises_the_prompts():
  cfg = t.tiny_cfg(*CAPS, "erpo.kl_on=prompt")
  batch = uniform_batch(2, [0, 1])
  split = capacities(batch, [0, 1])
  assert split.trained == 0
  split = split._replace(trained=8)  # the loop's smallest bucket holds padding slots only
  whole_metrics, whole_params = run(cfg, batch, split.whole)
  split_metrics, split_params = run(cfg, batch, split)
  for key, value in whole_metrics.items():
    assert split_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
  assert_same_update(cfg, whole_params, split_params, moved=0.01)  # the Query-KL's gradient alone
  assert whole_metrics["loss/pg"] == 0.0 and whole_metrics["kl/query"] > 0  # only the Query-KL moves the policy


def test_a_split_capacity_is_refused_where_a_loss_term_reads_every_response():
  batch = uniform_batch(2, [0])
  for overrides in (["erpo.kl_on=response", "erpo.reference=forward"], ["erpo.kl_on=all", "erpo.reference=forward"],
                    ["erpo.kl_on=prompt", "ppo.entropy_coef=0.01"]):
    cfg = t.tiny_cfg(*CAPS, *overrides)
    assert not packing.forward_only_applies(cfg)
    with pytest.raises(ValueError, match="forward_only_applies"):
      run(cfg, batch, capacities(batch, [0]))


def _host(lens):
  return batch_lib.HostRollout(tokens=None, prompt_mask=None, response_mask=None, prompt_len=None,
                               response_len=np.asarray(lens), truncated=None)


def test_the_loop_splits_the_capacity_only_where_it_applies_and_a_group_is_uniform():
  mesh = mesh_lib.make_mesh(t.tiny_cfg().mesh, devices=jax.devices()[:1])
  base = ["data.batch_size=4", "rollout.group_size=8", "rollout.max_new_tokens=64"]
  host = _host([40] * 16 + [10] * 16)  # 800 response tokens: 896 slots in multiples of 128
  # Groups 0 and 2 uniform: 320 + 80 tokens trained, 320 + 80 forward-only.
  rewards = np.array([0.0] * 8 + [1.0, 0.0] * 4 + [0.5] * 8 + [1.0, 0.0] * 4, np.float32)
  cfg = t.tiny_cfg(*base, "erpo.kl_on=prompt")
  assert packing.response_capacity(cfg, host, mesh) == 896  # no rewards: the whole batch's
  # 400 trained tokens fit half the 896 slots; the forward-only stream gets the other half and one response more.
  assert packing.response_capacity(cfg, host, mesh, rewards) == SplitCapacity(896, 448, 448 + 64)
  assert packing.response_capacity(cfg, host, mesh, np.arange(32, dtype=np.float32)) == 896  # none uniform
  for off in (["erpo.kl_on=response", "erpo.reference=forward"], ["model.forward_only_uniform_groups=false"],
              ["ppo.epochs=2"], ["ppo.entropy_coef=0.01"], ["model.pack_responses=false"]):
    assert packing.response_capacity(t.tiny_cfg(*base, "erpo.kl_on=prompt", *off), host, mesh, rewards) in (896, None)
  assert packing.response_capacity(t.tiny_cfg(*base, "erpo.kl_on=none"), host, mesh, rewards) == (896, 448, 512)


SHARDED = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    import forward_only_test as f, step_test as t
    from erpo_jax.model import logprobs
    from erpo_jax.parallel import mesh as mesh_lib
    out = {{}}
    batch = f.uniform_batch(4, [1, 2])
    for d, fs, tp in json.loads(sys.argv[1]):
      devices = jax.devices()[:d * fs * tp]
      cfg = t.tiny_cfg(*f.CAPS, "erpo.kl_on=prompt", "data.batch_size=4", f"mesh.data={{d}}", f"mesh.fsdp={{fs}}",
                       f"mesh.tensor={{tp}}")
      streams = logprobs.packed_streams(4, mesh_lib.num_batch_shards(mesh_lib.make_mesh(cfg.mesh, devices=devices)))
      split = f.capacities(batch, [1, 2], streams)
      step, _, params, ref, opt = t.build(cfg, devices=devices, with_reference=True)
      params, opt, m = step(params, opt, ref, batch, None, split)
      out[str((d, fs, tp))] = {{"streams": streams, "metrics": {{k: float(v) for k, v in m.items()}},
                               "params": [np.asarray(x).ravel()[:50].tolist() for x in jax.tree.leaves(params)]}}
    # More steps on the last mesh, the Policy-KL reference forward on every other one, as a run does.
    policy_kl = []
    for i in range(int(sys.argv[2])):
      params, opt, m = step(params, opt, ref, batch.replace(policy_kl=np.bool_(i % 2 == 0)), None, split)
      policy_kl.append(float(m["kl/policy"]))
    out["policy_kl"] = policy_kl
    print(json.dumps(out))
""")
MESHES = [(1, 1, 1), (2, 1, 1), (2, 2, 2)]  # one stream; two; four (one group each, one of them uniform)
MORE_STEPS = 100


@pytest.fixture(scope="module")
def sharded_runs():
  """One process on 8 CPU devices: a step on each mesh, then MORE_STEPS on the last. A collective that waits
  60 s for a device ends the process (XLA's flag), so a deadlock fails the tests in a minute."""
  env = multihost.cpu_device_env(os.environ, 8)
  env["XLA_FLAGS"] = re.sub(r"--xla_cpu_collective_call_terminate_timeout_seconds=\d+", "", env["XLA_FLAGS"])
  env["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=60"
  res = subprocess.run([sys.executable, "-c", SHARDED.format(tests=os.path.dirname(__file__)), json.dumps(MESHES),
                        str(MORE_STEPS)], env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  return json.loads(res.stdout.strip().splitlines()[-1])


def test_forward_only_uniform_groups_sharded_equal_one_device_on_8_cpu_devices(sharded_runs):
  out = sharded_runs
  base = out[str((1, 1, 1))]
  assert [out[str(m)]["streams"] for m in MESHES] == [1, 2, 4]
  for m in MESHES[1:]:
    got = out[str(m)]
    for k, v in base["metrics"].items():
      assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-5), (m, k)
    for a, b in zip(base["params"], got["params"]):
      np.testing.assert_allclose(b, a, atol=1e-5)


def test_the_policy_kl_reference_forward_on_alternate_steps_never_deadlocks_8_cpu_devices(sharded_runs):
  """The update with the Policy-KL reference forward in a `lax.cond` deadlocked about once in 20 calls on a
  CPU mesh of 8 devices (mesh.conditional_collectives_unsafe); there the forward runs in every step."""
  kl = np.array(sharded_runs["policy_kl"])
  assert len(kl) == MORE_STEPS
  assert np.all(np.isfinite(kl[0::2])) and np.all(kl[0::2] > 0)
  assert np.all(np.isnan(kl[1::2]))

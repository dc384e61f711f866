"""Tests of the sampler: cached greedy = full-forward greedy, log-probs, keys, EOS, buckets, sharding."""

import os
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from erpo_jax.buckets import prompt_bucket
from erpo_jax.errors import DataError
from erpo_jax.model import cpu_kernel, llama, logprobs
from erpo_jax.model.kv_cache import GroupKVCache
from erpo_jax.model.config import ModelConfig
from erpo_jax.parallel import multihost
from erpo_jax.rollout.sampler import Sampler, greedy_reference
from erpo_jax.rollout.sampling import categorical, sample_token, sample_token_columns

V = 64
# Untied lm-head: a tied random model mostly repeats its input token, which makes dull samples.
CFG = ModelConfig("llama", V, 32, 2, 4, 2, 8, 64, tie_word_embeddings=False)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], list(range(20, 32))]


@pytest.fixture(scope="module")
def model():
  return llama.init_random(CFG, seed=1)


def tok(eos_ids=(1, 2), pad_id=0):
  """The two tokenizer attributes the sampler reads."""
  return types.SimpleNamespace(eos_ids=eos_ids, pad_id=pad_id)


def response(r, n) -> list[int]:
  return np.asarray(r.tokens)[n][np.asarray(r.response_mask)[n]].tolist()


def test_prompt_bucket_is_power_of_two_at_least_min():
  assert [prompt_bucket(n, 16) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]
  assert prompt_bucket(3, 4) == 4


def test_prompts_cut_to_the_data_sets_longest_bucket_give_the_same_rollout(model):
  """With the data set's longest prompt known (12 tokens here), prompts pad to its fine bucket (16), not the
  power of two (32 at min_prompt_bucket 32): the same greedy responses, the same log-probs."""
  rollouts = []
  for longest in (None, 12):
    s = Sampler(model, tok(eos_ids=(V + 1,)), max_new_tokens=6, temperature=0.0, min_prompt_bucket=32)
    s.longest_prompt = longest
    rollouts.append(s.generate(model, PROMPTS, group_size=2, key=jax.random.key(0)))
  plain, cut = rollouts
  assert np.asarray(plain.tokens).shape == (8, 32 + 6) and np.asarray(cut.tokens).shape == (8, 16 + 6)
  for n in range(8):
    assert response(cut, n) == response(plain, n), n
    np.testing.assert_allclose(np.asarray(cut.logp)[n][np.asarray(cut.response_mask)[n]],
                               np.asarray(plain.logp)[n][np.asarray(plain.response_mask)[n]], atol=1e-5)


@pytest.mark.slow
def test_cached_greedy_equals_full_forward_argmax(model):
  M = 10
  s = Sampler(model, tok(eos_ids=(V + 1,)), max_new_tokens=M, temperature=0.0, min_prompt_bucket=4)
  r = s.generate(model, PROMPTS, group_size=2, key=jax.random.key(0))
  ref = greedy_reference(model, PROMPTS, M)
  for n in range(len(PROMPTS) * 2):
    assert response(r, n) == ref[n // 2], n
  assert np.asarray(r.tokens).shape == (8, 16 + M)  # P = bucket(12) = 16
  assert np.all(np.asarray(r.truncated))


def test_prompt_and_response_layout_is_group_contiguous(model):
  G, M = 3, 5
  s = Sampler(model, tok(eos_ids=(V + 1,)), max_new_tokens=M, min_prompt_bucket=4)
  r = s.generate(model, PROMPTS, group_size=G, key=jax.random.key(3), group_id_offset=100)
  tokens, pm, rm = np.asarray(r.tokens), np.asarray(r.prompt_mask), np.asarray(r.response_mask)
  assert np.asarray(r.group_id).tolist() == [100] * G + [101] * G + [102] * G + [103] * G
  for n in range(len(PROMPTS) * G):
    p = PROMPTS[n // G]
    assert tokens[n][pm[n]].tolist() == p  # row n = b*G + g holds prompt b
    assert int(r.prompt_len[n]) == len(p) and int(r.response_len[n]) == M
    assert np.flatnonzero(rm[n]).tolist() == list(range(len(p), len(p) + M))  # right after the prompt
    assert np.all(tokens[n][len(p) + M:] == 0)  # pad_id


@pytest.mark.parametrize("kernel", [False, True], ids=["xla", "cpu_kernel"])
def test_prefill_holds_each_prompts_keys_once_for_its_group(model, kernel):
  G, M = 4, 6
  with cpu_kernel.forced(kernel):
    kernel = cpu_kernel.usable(model.dtype)
    s = Sampler(model, tok(), max_new_tokens=M, min_prompt_bucket=4)
    tokens_BxP, len_B, _ = s.pad_prompts(PROMPTS)
    cache, logits_NxV = s._prefill(nnx.state(model), tokens_BxP, len_B, group_size=G)
  B, P = tokens_BxP.shape
  K, Dh = CFG.num_kv_heads, CFG.head_dim
  assert len(cache) == CFG.num_layers and logits_NxV.shape == (B * G, V)
  for c in cache:  # prompt slots per prompt, response slots per row
    assert c.prompt.k.shape == (B, K, Dh, P) and c.prompt.v.shape == (B, K, P, Dh)
    if kernel:  # the kernel's form: response keys slot-major, like the values
      assert isinstance(c, cpu_kernel.GroupCache) and c.k.shape == c.v.shape == (B * G, K, M, Dh)
    else:
      assert isinstance(c, GroupKVCache) and c.response.k.shape == (B * G, K, Dh, M)


def test_logp_at_temperature_one_equals_model_log_probs(model):
  s = Sampler(model, tok(), max_new_tokens=12, min_prompt_bucket=4)
  r = s.generate(model, PROMPTS, group_size=4, key=jax.random.key(7))
  want = logprobs.log_probs(model, r.tokens)
  mask = np.asarray(r.response_mask)
  np.testing.assert_allclose(np.asarray(r.logp)[mask], np.asarray(want)[mask], atol=1e-5)
  assert np.all(np.asarray(r.logp)[~mask] == 0)


def test_logp_at_temperature_is_of_the_tempered_distribution(model):
  s = Sampler(model, tok(), max_new_tokens=8, min_prompt_bucket=4)
  r = s.generate(model, PROMPTS, group_size=2, key=jax.random.key(7), temperature=0.6)
  want = logprobs.log_probs(model, r.tokens, prompt_len_N=r.prompt_len, temperature=0.6)  # responses at T
  mask = np.asarray(r.response_mask)
  np.testing.assert_allclose(np.asarray(r.logp)[mask], np.asarray(want)[mask], atol=1e-5)


def test_group_samples_differ_and_repeat_with_the_same_key(model):
  s = Sampler(model, tok(eos_ids=(V + 1,)), max_new_tokens=8, min_prompt_bucket=4)
  a = s.generate(model, PROMPTS[:2], group_size=4, key=jax.random.key(11))
  b = s.generate(model, PROMPTS[:2], group_size=4, key=jax.random.key(11))
  c = s.generate(model, PROMPTS[:2], group_size=4, key=jax.random.key(12))
  rows = [tuple(response(a, n)) for n in range(8)]
  assert len(set(rows[:4])) == 4 and len(set(rows[4:])) == 4  # the G samples of a prompt differ
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logp), np.asarray(b.logp))
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_response_mask_ends_at_the_first_eos_and_full_rows_are_truncated():
  # Vocabulary of 16 with 2 EOS ids: P(no EOS in 12 steps) is about (7/8)^12 = 0.2, so both cases occur.
  m = llama.init_random(ModelConfig("llama", 16, 32, 2, 4, 2, 8, 64, tie_word_embeddings=False), seed=2)
  M, eos, pad = 12, (3, 9), 15
  s = Sampler(m, tok(eos_ids=eos, pad_id=pad), max_new_tokens=M, min_prompt_bucket=4)
  r = s.generate(m, [[4, 5], [6, 7, 8, 10, 11]], group_size=16, key=jax.random.key(5))
  tokens, rm, logp = np.asarray(r.tokens), np.asarray(r.response_mask), np.asarray(r.logp)
  trunc = np.asarray(r.truncated)
  assert 0 < trunc.sum() < 32
  for n in range(32):
    L, R = int(r.prompt_len[n]), int(r.response_len[n])
    resp = tokens[n, L:L + R].tolist()
    assert np.flatnonzero(rm[n]).tolist() == list(range(L, L + R))
    assert not any(t in eos for t in resp[:-1])  # nothing after the first EOS is in the response
    if trunc[n]:
      assert R == M and resp[-1] not in eos
    else:
      assert resp[-1] in eos and R <= M
    assert np.all(tokens[n, L + R:] == pad) and np.all(logp[n, L + R:] == 0)
    assert np.all(logp[n, L:L + R] < 0)


def test_greedy_stops_at_an_eos_it_emits(model):
  ref = greedy_reference(model, PROMPTS, 6)
  eos = ref[0][3]  # prompt 0's 4th greedy token; it must be its first occurrence for this check
  assert eos not in ref[0][:3]
  s = Sampler(model, tok(eos_ids=(V + 1, eos)), max_new_tokens=6, temperature=0.0, min_prompt_bucket=4)
  r = s.generate(model, PROMPTS, group_size=1, key=jax.random.key(0))
  assert response(r, 0) == ref[0][:4] and not bool(r.truncated[0])


@pytest.mark.slow
def test_compiles_once_per_prompt_bucket(model):
  s = Sampler(model, tok(), max_new_tokens=3, min_prompt_bucket=4)
  rng = np.random.default_rng(0)
  state = nnx.state(model)
  buckets = set()
  for i in range(20):
    lens = rng.integers(1, 40, size=2)
    buckets.add(prompt_bucket(int(lens.max()), 4))
    prompts = [rng.integers(3, V, size=n).tolist() for n in lens]
    # New weights and temperature each call, as in training: neither may retrace.
    state = jax.tree.map(lambda x: x * 1.0, state)
    s.generate(state, prompts, group_size=2, key=jax.random.key(i), temperature=0.5 + i / 20)
  assert len(buckets) >= 3
  assert s._prefill._cache_size() == len(buckets)
  assert s._decode._cache_size() == len(buckets)
  assert s.traces == 2 * len(buckets)


def test_overlong_prompts_keep_their_last_tokens_and_are_counted(model):
  s = Sampler(model, tok(eos_ids=(V + 1,)), max_new_tokens=2, min_prompt_bucket=4, max_prompt_len=5)
  r = s.generate(model, [list(range(10, 20)), [4, 5]], group_size=2, key=jax.random.key(0))
  tokens, pm = np.asarray(r.tokens), np.asarray(r.prompt_mask)
  assert tokens[0][pm[0]].tolist() == [15, 16, 17, 18, 19]
  assert np.asarray(r.prompt_truncated).tolist() == [True, True, False, False]
  assert s.overlong_prompts == 1
  strict = Sampler(model, tok(), max_new_tokens=2, max_prompt_len=5, on_overlong="error")
  with pytest.raises(DataError, match="prompt 0 has 10 tokens"):
    strict.generate(model, [list(range(10, 20))], group_size=1, key=jax.random.key(0))


def test_top_p_and_top_k_sample_from_the_renormalised_head():
  # p = [.5, .3, .15, .05]; top_p = .7 keeps {0, 1} (mass before them 0 and .5 < .7; before 2 it is .8).
  p = jnp.array([0.5, 0.3, 0.15, 0.05])
  logits = jnp.broadcast_to(jnp.log(p), (2000, 4))
  t, lp = sample_token(logits, jax.random.key(0), 1.0, greedy=False, top_k=0, top_p=0.7)
  assert set(np.asarray(t).tolist()) == {0, 1}
  np.testing.assert_allclose(lp, jnp.log(p[t] / 0.8), rtol=1e-5)
  assert abs(float(jnp.mean(t == 0)) - 0.5 / 0.8) < 0.04  # 3 sigma of a binomial mean over 2000
  t, lp = sample_token(logits, jax.random.key(1), 1.0, greedy=False, top_k=3, top_p=1.0)
  assert set(np.asarray(t).tolist()) == {0, 1, 2}
  np.testing.assert_allclose(lp, jnp.log(p[t] / 0.95), rtol=1e-5)
  t, lp = sample_token(logits, jax.random.key(2), 1.0, greedy=False, top_k=3, top_p=0.5)
  assert set(np.asarray(t).tolist()) == {0} and np.allclose(lp, 0.0)


def test_inverse_cdf_draws_follow_softmax_and_never_pick_zero_mass_tokens():
  # V = 300 is not a multiple of the 128-token block; tokens 0, 129 and 299 have zero mass.
  rng = np.random.default_rng(0)
  logits = rng.normal(0.0, 1.5, 300).astype(np.float32)
  logits[[0, 129, 299]] = np.finfo(np.float32).min
  p = np.asarray(jax.nn.softmax(jnp.asarray(logits)))
  n = 200_000
  draws = np.asarray(categorical(jax.random.key(3), jnp.broadcast_to(jnp.asarray(logits), (n, 300))))
  counts = np.bincount(draws, minlength=300)
  assert counts[[0, 129, 299]].sum() == 0
  # Pearson chi-square over 297 categories: mean 296, sd 24; 450 is 6 sd out.
  live = p > 0
  chi2 = float(np.sum((counts[live] - n * p[live]) ** 2 / (n * p[live])))
  assert chi2 < 450, chi2
  # Same key, same draws; another key, other draws.
  again = np.asarray(categorical(jax.random.key(3), jnp.broadcast_to(jnp.asarray(logits), (n, 300))))
  other = np.asarray(categorical(jax.random.key(4), jnp.broadcast_to(jnp.asarray(logits), (n, 300))))
  assert (again == draws).all() and (other != draws).mean() > 0.9


def test_drawn_logp_equals_log_softmax_also_for_unlikely_tokens_after_one_exp_over_the_vocab():
  # Logits spread over ~100 nats: some draws land on tokens of mass 1e-4 and below in their column.
  V_, N_ = 1000, 512
  logits_VxN = jax.random.normal(jax.random.key(5), (V_, N_)) * 12.0
  lowest = 0.0
  for temperature in (1.0, 0.7, 2.5):
    tok_N, logp_N = sample_token_columns(logits_VxN, jax.random.key(6), temperature, greedy=False, top_k=0,
                                         top_p=1.0)
    want = jnp.take_along_axis(jax.nn.log_softmax(logits_VxN / temperature, axis=0), tok_N[None], axis=0)[0]
    np.testing.assert_allclose(logp_N, want, rtol=1e-6, atol=2e-5)
    lowest = min(lowest, float(jnp.min(want)))
  assert lowest < -9.0  # some draws were that unlikely
  # The draw and its log-prob come from one exp over the [V, N] logits, not one each.
  jaxpr = jax.make_jaxpr(lambda x: sample_token_columns(x, jax.random.key(0), 1.0, greedy=False, top_k=0,
                                                         top_p=1.0))(logits_VxN)
  assert _vocab_sized_exps(jaxpr.jaxpr, V_ * N_) == 1


def _vocab_sized_exps(jaxpr, size: int) -> int:
  """exp equations with at least `size` outputs in a jaxpr and the jaxprs inside it (jit, custom_jvp)."""
  n = 0
  for e in jaxpr.eqns:
    n += e.primitive.name == "exp" and e.outvars[0].aval.size >= size
    for v in e.params.values():
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        n += _vocab_sized_exps(inner, size)
  return n


def test_inverse_cdf_draws_a_one_hot_row_exactly():
  logits = jnp.full((64, 1000), jnp.finfo(jnp.float32).min).at[:, 517].set(0.0)
  assert (np.asarray(categorical(jax.random.key(0), logits)) == 517).all()


@pytest.mark.slow
def test_top_k_one_sampling_equals_greedy(model):
  s = Sampler(model, tok(eos_ids=(V + 1,)), max_new_tokens=6, top_k=1, min_prompt_bucket=4)
  r = s.generate(model, PROMPTS, group_size=2, key=jax.random.key(4))
  ref = greedy_reference(model, PROMPTS, 6)
  assert [response(r, n) for n in range(0, 8, 2)] == ref
  assert np.allclose(np.asarray(r.logp), 0.0)  # the renormalised head has probability 1


_SHARDED = textwrap.dedent("""
    import types, jax, numpy as np
    from erpo_jax.parallel import mesh as mesh_lib
    from erpo_jax.config_run import MeshSection
    from erpo_jax.model import llama
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.rollout.sampler import Sampler
    assert jax.device_count() == 8
    m = llama.init_random(ModelConfig("llama", 64, 32, 2, 4, 2, 8, 64, tie_word_embeddings=False), seed=1)
    t = types.SimpleNamespace(eos_ids=(1, 2), pad_id=0)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [3], [20, 21]]
    mesh = mesh_lib.make_mesh(MeshSection(data=4, fsdp=2))
    args = dict(max_new_tokens=6, min_prompt_bucket=4)
    a = Sampler(m, t, mesh=mesh, **args).generate(m, prompts, group_size=4, key=jax.random.key(0))
    b = Sampler(m, t, **args).generate(m, prompts, group_size=4, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.logp), np.asarray(b.logp), atol=1e-5)
    assert a.tokens.sharding.spec[0] == ("data", "fsdp"), a.tokens.sharding
    row_blocks = {s.index[0].indices(16)[:2] for s in a.tokens.addressable_shards}
    print("row blocks", len(row_blocks))
""")


def test_sharded_batch_on_eight_cpu_devices_matches_one_device():
  env = multihost.cpu_device_env(os.environ, 8)
  out = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "row blocks 8" in out.stdout  # N = 16 rows in 8 blocks of 2


@pytest.mark.slow
def test_smollm2_cached_greedy_equals_full_forward_argmax():
  from erpo_jax.config import ModelSection
  from erpo_jax.model.io.loading import load_model

  m, t = load_model(ModelSection(path="builtin:smollm2-135m-instruct"))
  qs = ["What is 7+5?", "Name a prime number larger than ten, please.", "Hi"]
  prompts = [t.encode(t.render_chat([{"role": "user", "content": q}])) for q in qs]
  M = 16
  s = Sampler(m, types.SimpleNamespace(eos_ids=(10**6,), pad_id=t.pad_id), max_new_tokens=M, temperature=0.0)
  r = s.generate(m, prompts, group_size=1, key=jax.random.key(0))
  assert [response(r, n) for n in range(3)] == greedy_reference(m, prompts, M)
  assert t.decode(response(r, 0)).startswith("7 + 5 = 12")


_TWO_PROCESSES = textwrap.dedent("""
    import argparse, types
    import numpy as np
    from erpo_jax.parallel import multihost, transfer
    parser = argparse.ArgumentParser()
    for flag in ("--coordinator", "--num-processes", "--process-id"):
      parser.add_argument(flag)
    args = parser.parse_args()
    multihost.maybe_initialize(args.coordinator, int(args.num_processes), int(args.process_id))
    import jax
    from erpo_jax.parallel import mesh as mesh_lib
    from erpo_jax.config_run import MeshSection
    from erpo_jax.model import llama
    from erpo_jax.model.config import ModelConfig
    from erpo_jax.rollout.sampler import Sampler
    cfg = ModelConfig("llama", 64, 32, 2, 4, 2, 8, 64, tie_word_embeddings=False)
    t = types.SimpleNamespace(eos_ids=(1, 2), pad_id=0)
    # Process 1's first prompt is longer: both processes must still agree on one bucket.
    prompts = [[5, 6, 7], [8, 9], list(range(10, 30)), [3]]
    p = jax.process_index()
    args = dict(max_new_tokens=5, min_prompt_bucket=4)
    local = llama.init_random(cfg, seed=1)
    want = Sampler(local, t, **args).generate(local, prompts, group_size=2, key=jax.random.key(0))
    mesh = mesh_lib.make_mesh(MeshSection())
    m = mesh_lib.shard_model(llama.init_random(cfg, seed=1), mesh)
    r = Sampler(m, t, mesh=mesh, **args).generate(m, prompts[2 * p:2 * p + 2], group_size=2, key=jax.random.key(0))
    own = transfer.global_to_host_local(r.tokens)
    np.testing.assert_array_equal(own, np.asarray(want.tokens)[4 * p:4 * p + 4])
    np.testing.assert_array_equal(transfer.global_to_host_local(r.group_id), [2 * p] * 2 + [2 * p + 1] * 2)
    print("OK", p)
""")


@pytest.mark.slow
def test_two_processes_each_get_back_their_own_rows():
  from erpo_jax.parallel import multihost

  runs = multihost.run_local_processes([sys.executable, "-c", _TWO_PROCESSES], 2, cpu_devices=2, timeout_s=300)
  assert [rc for rc, _ in runs] == [0, 0], "\n----\n".join(out[-3000:] for _, out in runs)
  assert [f"OK {i}" in out for i, (_, out) in enumerate(runs)] == [True, True]

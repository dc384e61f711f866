"""The reference pass with the prompts' common prefix run once: the same log-probs as each prompt alone,
every prompt placed once, and the prefix layout only where it computes less."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.config_io import load_config
from erpo_jax.data import reference_layout, reference_pass
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.model import logprobs
from erpo_jax.model.io.loading import load_model, load_tokenizer


class FourShards:
  shape = {"data": 2, "fsdp": 2, "tensor": 2}


def test_common_prefix_is_what_every_prompt_starts_with_and_leaves_each_a_token_of_its_own():
  assert reference_layout.common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 9]]) == 2
  assert reference_layout.common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # identical: the last token is own
  assert reference_layout.common_prefix_length([[7, 8, 9]]) == 2
  assert reference_layout.common_prefix_length([[5], [5, 6]]) == 0
  assert reference_layout.common_prefix_length([[1, 2, 3], [4, 2, 3]]) == 0
  assert reference_layout.common_prefix_length([]) == 0
  assert reference_layout.common_prefix_length([[1, 2], []]) == 0


def test_prefix_plan_places_every_prompt_once_in_streams_of_one_shape_and_near_equal_load():
  rng = np.random.default_rng(0)
  lengths = rng.integers(36, 44, size=512)  # the embedded default's prompt lengths, 24 of them shared
  plan = reference_layout.plan_prefix_pass(lengths, 24, 1024, FourShards())
  placed = sorted(q for call in plan.calls for stream in call for q in stream)
  assert placed == list(range(512))
  assert plan.streams == 4 and all(len(call) == 4 for call in plan.calls)
  suffix = lengths - 24
  loads = [int(suffix[list(stream)].sum()) for call in plan.calls for stream in call]
  assert len(plan.calls) == -(-int(suffix.sum()) // 1024)  # about 1024 suffix tokens a call
  assert all(len(stream) <= plan.rows_per_stream for call in plan.calls for stream in call)
  assert max(loads) <= plan.capacity < max(loads) + 64 and max(loads) - min(loads) <= suffix.max()
  assert plan.suffix_bucket >= suffix.max()
  assert plan.computed_tokens == len(plan.calls) * 4 * (24 + plan.capacity)


def test_the_prefix_layout_is_chosen_only_where_it_computes_less():
  rng = np.random.default_rng(1)
  prefix = rng.integers(1, 1000, size=24).tolist()
  templated = [prefix + rng.integers(1, 1000, size=n).tolist() for n in rng.integers(12, 20, size=64)]
  assert isinstance(reference_layout.choose_plan(templated, 1024), reference_layout.PrefixPlan)
  assert isinstance(reference_layout.choose_plan(templated, 1024, shared_prefix=False), reference_layout.PackedPass)
  # One shared token is no prefix; a short prefix before one very long suffix would widen every suffix row's
  # attention to that suffix's bucket: both keep whole prompts.
  assert isinstance(reference_layout.choose_plan([[3, 4, 5], [3, 6, 7, 8]], 1024), reference_layout.PackedPass)
  skewed = [[1, 2, 3, 4] + [5] * n for n in [2] * 40 + [500]]
  plan = reference_layout.plan_prefix_pass(np.array([len(p) for p in skewed]), 4, 1024)
  packed = reference_layout.plan_packing(np.array([len(p) for p in skewed]), 1024)
  assert plan.computed_tokens < packed.computed_tokens and plan.attention_area > packed.attention_area
  assert isinstance(reference_layout.choose_plan(skewed, 1024), reference_layout.PackedPass)


def alone_logp(model, prompts, chunk):
  """Each prompt in a row of its own, right-padded (a padded key is never before a valid query)."""
  L = max(len(p) for p in prompts)
  rows = np.zeros((len(prompts), L), np.int32)
  for q, ids in enumerate(prompts):
    rows[q, :len(ids)] = ids
  return np.asarray(jax.jit(lambda t: logprobs.log_probs(model, t, chunk=chunk))(jnp.asarray(rows)))


@pytest.mark.parametrize("prefix_len", [2, 20])
def test_prefix_pass_gives_each_prompt_its_log_probs_alone(prefix_len):
  """Prompts of a shared prefix and own tokens of 1-70 (three calls, streams of unequal fill) score as they do
  alone, token by token, the prefix's positions included; nothing is written past a prompt."""
  model, _ = load_model(load_config("configs/tiny.yaml").model)
  rng = np.random.default_rng(prefix_len)
  prefix = rng.integers(1, 49152, size=prefix_len).tolist()
  prompts = [prefix + rng.integers(1, 49152, size=n).tolist() for n in (1, 70, 5, 17, 3, 40, 2, 33, 9, 60, 1, 25)]
  lengths = np.array([len(p) for p in prompts])
  assert reference_layout.common_prefix_length(prompts) == prefix_len
  plan = reference_layout.plan_prefix_pass(lengths, prefix_len, 96)
  assert len(plan.calls) == 3 and plan.rows_per_stream == 4
  logp = np.zeros((len(prompts), lengths.max()), np.float32)
  calls = []
  reference_pass.prefix_pass_logp(model, prompts, plan, logp, chunk=64, on_call=calls.append)
  assert calls == [4, 4, 4]
  alone = alone_logp(model, prompts, 64)
  for q, ids in enumerate(prompts):
    assert logp[q, 0] == 0 and np.all(logp[q, 1:len(ids)] < 0)
    np.testing.assert_allclose(logp[q, :len(ids)], alone[q, :len(ids)], rtol=2e-5, atol=2e-5)
    assert not logp[q, len(ids):].any()


def test_the_default_data_sets_prompts_share_their_template_and_score_alike_in_both_layouts():
  """The embedded default's chat-templated arithmetic prompts: 24 shared tokens, about a third of the tokens
  computed, and the same log-probs as whole prompts packed end to end (a tiny model over the real tokenizer)."""
  cfg = load_config("configs/tiny.yaml", ["data.chat_template=true", "data.max_prompt_tokens=64", "data.size=96",
                                          "data.levels=[1,2,3]"])
  prompts = [t for t, _ in dataset_prompts(cfg, load_tokenizer(cfg.model))]
  plan = reference_layout.choose_plan(prompts, 1024)
  packed = reference_layout.plan_packing(np.array([len(p) for p in prompts]), 1024)
  assert isinstance(plan, reference_layout.PrefixPlan) and plan.prefix_len == 24
  assert plan.computed_tokens < 0.45 * packed.computed_tokens
  model, _ = load_model(cfg.model)
  shared, _ = reference_pass.compute_reference_logp(model, prompts, tokens_per_batch=1024, chunk=64, progress=False)
  whole, _ = reference_pass.compute_reference_logp(model, prompts, tokens_per_batch=1024, chunk=64, progress=False,
                                                   shared_prefix=False)
  np.testing.assert_allclose(shared, whole, rtol=2e-5, atol=2e-5)
  assert np.abs(whole).sum() > 100.0


def test_static_weights_from_the_cache_are_the_same_with_and_without_the_shared_prefix(tmp_path):
  """`model.shared_prefix` reaches the pass through ensure_reference_cache; the cached weights, NLLs and
  log-probs agree with the whole-prompt pass's."""
  from erpo_jax.data import reference_cache
  caches = {}
  for shared in (True, False):
    cfg = load_config("configs/tiny.yaml", ["data.chat_template=true", "data.max_prompt_tokens=64", "data.size=48",
                                            f"model.shared_prefix={str(shared).lower()}",
                                            f"run.dir={tmp_path / str(shared)}"])
    model, tokenizer = load_model(cfg.model)
    caches[shared] = reference_cache.ensure_reference_cache(cfg, model, tokenizer)
  on, off = caches[True], caches[False]
  assert on.keys == off.keys  # one cache serves both settings
  np.testing.assert_allclose(on.nll, off.nll, rtol=1e-5)
  np.testing.assert_allclose(on.weights, off.weights, rtol=1e-5)
  np.testing.assert_allclose(on.logp, off.logp, rtol=2e-5, atol=2e-5)
  assert on.weights.std() > 0.01  # the weights differ from question to question

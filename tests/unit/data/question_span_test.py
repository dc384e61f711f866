"""erpo.query_span=question: the Query-KL and the question NLL cover the question's tokens only."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from erpo_jax.config_io import load_config
from erpo_jax.data import reference_cache, reference_pass
from erpo_jax.data.prompts import encode_prompt
from erpo_jax.data.records import Record
from erpo_jax.errors import UserError
from erpo_jax.model import llama, logprobs
from erpo_jax.model.io.loading import load_tokenizer
from erpo_jax.model.tokenizer import Tokenizer

# Qwen2.5's chat template without its tool-calling branches: a default system prompt when none is given.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == "
    "'system' and loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

QUESTIONS = ["What is 7+5?", "Compute 48 - 19.", "A box holds 6 pencils. How many pencils are in 7 boxes?"]


def smollm2_cfg(*overrides):
  return load_config("configs/tiny.yaml", ["data.chat_template=true", "data.prompt_suffix=' Put the answer in "
                                           "\\boxed{}.'", "data.max_prompt_tokens=128", *overrides])


@pytest.fixture(scope="module")
def smollm2_tokenizer():
  return load_tokenizer(smollm2_cfg().model)


def qwen_style(tok: Tokenizer) -> Tokenizer:
  return Tokenizer(tok.backend, chat_template=QWEN25_TEMPLATE, eos_ids=tok.eos_ids, bos_id=tok.bos_id,
                   pad_id=tok.pad_id)


@pytest.mark.parametrize("template", ["smollm2", "qwen2.5"])
def test_question_mask_covers_exactly_the_question_tokens(smollm2_tokenizer, template):
  tok = smollm2_tokenizer if template == "smollm2" else qwen_style(smollm2_tokenizer)
  data = smollm2_cfg().data
  for i, q in enumerate(QUESTIONS):
    enc = encode_prompt(Record(id=str(i), prompt=q, answer="1", source="test"), tok, data)
    mask = np.asarray(enc.question_mask)
    assert tok.decode([t for t, m in zip(enc.tokens, mask) if m]).strip() == q
    assert mask.sum() < len(enc.tokens) - 5  # the template's system turn, headers and suffix are outside
    inside = np.flatnonzero(mask)
    assert np.all(np.diff(inside) == 1)  # one contiguous run of tokens
    outside = tok.decode([t for t, m in zip(enc.tokens, mask) if not m])
    assert "Put the answer in" in outside and q not in outside
    if template == "qwen2.5":
      assert "You are Qwen" in outside


def test_question_span_static_weights_differ_from_prompt_span_and_match_a_hand_computation(tmp_path,
                                                                                         smollm2_tokenizer):
  cfg = smollm2_cfg(f"run.dir={tmp_path}")
  model = llama.init_random(llama.model_config_from_random_init(cfg.model.random_init))
  encoded = [encode_prompt(Record(id=str(i), prompt=q, answer="1", source="test"), smollm2_tokenizer, cfg.data)
             for i, q in enumerate(QUESTIONS)]
  tokens = [e.tokens for e in encoded]
  logp, lengths = reference_pass.compute_reference_logp(model, tokens, chunk=64, progress=False)
  by_span = {}
  for span, masks in (("prompt", None), ("question", [e.question_mask for e in encoded])):
    by_span[span] = reference_cache.build_cache(logp, lengths, 0.0, 2.0, keys={}, question_masks=masks)
  # By hand: each prompt alone through the model; s_q sums -log p over the question's tokens (t >= 1).
  nll = []
  for e in encoded:
    lp = np.asarray(logprobs.log_probs(model, jnp.asarray([e.tokens]), chunk=64))[0]
    nll.append(-sum(lp[t] for t in range(1, len(e.tokens)) if e.question_mask[t]))
  nll = np.array(nll)
  np.testing.assert_allclose(by_span["question"].nll, nll, rtol=1e-5)
  np.testing.assert_allclose(by_span["question"].weights, np.clip(nll.mean() / nll, 0.0, 2.0), rtol=1e-5)
  assert np.all(by_span["question"].nll < by_span["prompt"].nll)
  assert not np.allclose(by_span["question"].weights, by_span["prompt"].weights, rtol=1e-3)


def test_a_cache_made_for_the_prompt_span_is_refused_for_the_question_span(tmp_path):
  cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}"])
  model = llama.init_random(llama.model_config_from_random_init(cfg.model.random_init))
  tokenizer = load_tokenizer(cfg.model)
  keys = reference_cache.expected_keys(cfg, model, tokenizer, [[1, 2, 3]])
  question = dataclasses.replace(cfg, erpo=dataclasses.replace(cfg.erpo, query_span="question"))
  path = tmp_path / "cache.npz"
  logp = np.array([[0.0, -1.0, -2.0]], np.float32)
  reference_cache.save_cache(path, reference_cache.build_cache(logp, np.array([3]), 0.0, 2.0, keys=keys))
  with pytest.raises(UserError, match="stale reference cache: its span differ"):
    reference_cache.load_cache(path, reference_cache.expected_keys(question, model, tokenizer, [[1, 2, 3]]))

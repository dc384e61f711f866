"""Host-side batch assembly: a rollout's rows to numpy, rewards and cached reference values in, one UpdateBatch out.

Dimension letters: N rows (this process's), S sequence length, B prompts, G samples per prompt.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from erpo_jax import buckets
from erpo_jax.errors import UserError
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import transfer
from erpo_jax.train import step as train_step


@dataclasses.dataclass
class HostRollout:
  """The addressable rows of a rollout, as numpy."""

  tokens: np.ndarray  # [N, S] int32
  prompt_mask: np.ndarray  # [N, S] bool
  response_mask: np.ndarray  # [N, S] bool
  prompt_len: np.ndarray  # [N]
  response_len: np.ndarray  # [N]
  truncated: np.ndarray  # [N] bool


def to_host(roll) -> HostRollout:
  local = transfer.global_to_host_local
  return HostRollout(tokens=local(roll.tokens), prompt_mask=local(roll.prompt_mask),
                     response_mask=local(roll.response_mask), prompt_len=local(roll.prompt_len),
                     response_len=local(roll.response_len), truncated=local(roll.truncated))


def assemble_batch(h: HostRollout, rewards_N: np.ndarray, index_B: np.ndarray, group_size: int, ref_cache,
                   mesh, question_masks_B: list | None = None, policy_kl: bool = False) -> train_step.UpdateBatch:
  """Trims to the longest row of all processes (bucketed), fills cached reference log-probs and static weights.

  query_mask is the prompt mask, or with question_masks_B (erpo.query_span=question: one bool list per
  local prompt, over its tokens) only the question's tokens. policy_kl: the step logs kl/policy (the same on
  every process). Each process passes its own rows; all must call it (one collective agrees on S).
  """
  N, S_full = h.tokens.shape
  longest = transfer.allgather_rows(np.array([(h.prompt_len + h.response_len).max()]))
  S = min(S_full, buckets.sequence_bucket(int(longest.max())))
  ref_logp = np.zeros((N, S), np.float32)
  static_w = np.ones((N,), np.float32)
  if ref_cache is not None:
    q_N = np.repeat(index_B, group_size)
    static_w = ref_cache.weights[q_N].astype(np.float32)
    for n, q in enumerate(q_N):
      L = int(h.prompt_len[n])
      if L != int(ref_cache.prompt_len[q]):
        raise UserError(f"reference cache: training prompt {q} has {int(ref_cache.prompt_len[q])} tokens in the "
                        f"cache but {L} in this batch; the cache was made for other prompts: delete it or run "
                        f"'erpo-jax weights --config ...' to rebuild it")
      ref_logp[n, :L] = ref_cache.logp[q, :L]
  query_mask = h.prompt_mask[:, :S]
  if question_masks_B is not None:
    query_mask = np.zeros((N, S), bool)
    for n in range(N):
      m = question_masks_B[n // group_size]
      if m is None or len(m) != int(h.prompt_len[n]):
        raise UserError(f"erpo.query_span=question: the question of training prompt {int(index_B[n // group_size])} "
                        "cannot be located in its tokens; use erpo.query_span=prompt")
      query_mask[n, :len(m)] = m
  local = dict(tokens=h.tokens[:, :S].astype(np.int32), prompt_mask=h.prompt_mask[:, :S], query_mask=query_mask,
               response_mask=h.response_mask[:, :S], rewards=rewards_N.astype(np.float32), ref_logp=ref_logp,
               static_weight=static_w, truncated=h.truncated.astype(bool), policy_kl=np.bool_(policy_kl))
  return train_step.UpdateBatch(**{
      k: transfer.host_local_to_global(v, mesh_lib.batch_sharding(mesh, v.ndim)) for k, v in local.items()})


def rollout_metrics(h: HostRollout, rewards_N: np.ndarray, correct_N: np.ndarray, seconds: float,
                    timeouts: int = 0, crashes: int = 0, penalty_N: np.ndarray | None = None) -> dict[str, float]:
  """Reward, length and throughput statistics of the GLOBAL batch from each process's rows.

  A collective (every process calls it): the per-row values of all processes
  are gathered, so every process returns the statistics one process with the
  whole batch would. rewards_N is what the advantages see (verifier reward plus
  penalty_N, the overlong penalty; None = 0); correct_N the verifier's
  judgement. tokens_per_s = (prompt + response tokens) / seconds.
  """
  penalty_N = np.zeros(len(rewards_N), np.float32) if penalty_N is None else penalty_N
  cols_Nx6 = np.stack([rewards_N, correct_N, h.prompt_len, h.response_len, h.truncated, penalty_N],
                      axis=1).astype(np.float32)
  rewards, correct, prompt_len, response_len, truncated, penalty = (
      transfer.allgather_rows(cols_Nx6).astype(np.float64).T)
  timeouts, crashes = transfer.allgather_rows(np.array([[timeouts, crashes]], np.float32)).sum(axis=0)
  return {
      "reward/mean": float(rewards.mean()),
      "reward/std": float(rewards.std()),
      "reward/accuracy": float(correct.mean()),
      "reward/overlong_penalty": float(penalty.mean()),
      "prompt/len_mean": float(prompt_len.mean()),  # tokens
      "response/len_mean": float(response_len.mean()),
      "response/len_max": float(response_len.max()),
      "response/truncated": float(truncated.mean()),
      "perf/tokens_per_s": float(prompt_len.sum() + response_len.sum()) / seconds,
      "reward/verifier_timeouts": float(timeouts),
      "reward/verifier_timeout_rate": float(timeouts) / max(1, len(rewards)),
      "reward/verifier_crashes": float(crashes),
  }

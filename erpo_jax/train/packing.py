"""Packed response streams of the update: how many slots each needs, and which rows run forward-only.

Dimension letters: N rows (all processes'), G samples per prompt, R response bucket.

With packing (model.pack_responses) the update lays the responses end to end in one stream per batch shard
of a static capacity (`response_capacity`). With model.forward_only_uniform_groups, where it applies, the
responses of groups whose rewards are all equal (advantage exactly 0, `algo.advantages`) leave the stream
that runs backward: they get one of their own that runs forward only, so the step still logs their entropy,
ratios and Policy-KL, and the backward covers the groups that teach something. The gradient is the same:
with no response penalty and no entropy bonus, a zero-advantage row's response positions carry none.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax import buckets
from erpo_jax.algo import advantages
from erpo_jax.model import logprobs
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import transfer


class SplitCapacity(NamedTuple):
  """Slots per stream when uniform groups run forward-only: the whole batch's (for whole-batch forwards),
  the trained rows' and the forward-only rows'. Static: each value compiles once."""

  whole: int
  trained: int
  forward_only: int


def forward_only_applies(cfg) -> bool:
  """model.forward_only_uniform_groups takes effect: packed responses (one minibatch, one epoch: the
  forward-only values are those of the update's parameters) and no loss term that reads a zero-advantage
  row's responses (a response penalty or an entropy bonus)."""
  p = cfg.ppo
  return bool(cfg.model.forward_only_uniform_groups and cfg.model.shared_prefix and cfg.model.pack_responses
              and p.minibatches * p.microbatches * p.epochs == 1 and cfg.erpo.kl_on in ("prompt", "none")
              and p.entropy_coef == 0)


def forward_only_rows(rewards_N, len_N, group_size: int, streams: int, capacity: int, xp=np):
  """[N] bool: the rows whose responses run forward-only: in each stream's row order, the rows of groups whose
  rewards are all equal as long as their tokens so far fit `capacity`; the uniform rows after them run in the
  trained stream's spare slots. Exact integer sums, the same in the step (xp=jax.numpy) as on the host."""
  uniform_N = advantages.uniform_group_rows(rewards_N, group_size, xp)
  tokens_SxN = xp.where(uniform_N, len_N, 0).reshape(streams, -1)
  return uniform_N & (xp.cumsum(tokens_SxN, axis=1).reshape(-1) <= capacity)


def response_capacity(cfg, h, mesh, rewards_N: np.ndarray | None = None, programs=None,
                      prompt_bucket: int | None = None) -> int | SplitCapacity | None:
  """Static slots of each packed response stream (all processes agree), or None: no packing.

  Packing runs on one minibatch (a stream crosses rows) and on batch shards
  that hold whole groups: one stream per shard (`logprobs.packed_streams`),
  each with the slots the fullest stream needs. Given this process's rewards (`h`'s rows), and where
  `forward_only_applies`, a batch with uniform groups may get a SplitCapacity (`capacity_of`). Given the run's
  `programs.Programs`, a larger capacity it has compiled may stand in (`Programs.choose`).
  """
  if not (cfg.model.shared_prefix and cfg.model.pack_responses and cfg.ppo.minibatches * cfg.ppo.microbatches == 1):
    return None
  R, G = cfg.rollout.max_new_tokens, cfg.rollout.group_size
  len_N = transfer.allgather_rows(np.minimum(h.response_len, R).astype(np.int32)[:, None])[:, 0]
  streams = logprobs.packed_streams(len(len_N) // G, mesh_lib.num_batch_shards(mesh))
  if streams == 0:
    return None
  if rewards_N is not None and forward_only_applies(cfg):
    rewards_N = transfer.allgather_rows(np.asarray(rewards_N, np.float32)[:, None])[:, 0]
  else:
    rewards_N = None
  needed = capacity_of(len_N, rewards_N, G, streams, R)
  return needed if programs is None else programs.choose(prompt_bucket, needed, len_N, rewards_N, G, streams, R)


def stream_tokens(tokens_N, streams: int) -> int:
  """The fullest stream's tokens: the rows split in `streams` equal runs, each run's sum."""
  return int(np.asarray(tokens_N).reshape(streams, -1).sum(axis=1).max())


def capacity_of(len_N: np.ndarray, rewards_N: np.ndarray | None, group_size: int, streams: int,
                max_new_tokens: int) -> int | SplitCapacity:
  """`response_capacity` of all processes' rows: the whole batch's slots (`buckets.packed_capacity`), or with
  rewards a SplitCapacity when the rows outside uniform groups fit a quarter or a half of them (two programs
  per capacity, each compiled once). The forward-only stream gets the rest and one response more, so the
  uniform rows that do not fit it (`forward_only_rows`) fit the trained stream's spare slots."""
  R = max_new_tokens
  slots = (len(len_N) // streams) * R
  most = lambda tokens_N: stream_tokens(tokens_N, streams)
  whole = buckets.packed_capacity(most(len_N), slots)
  if rewards_N is None:
    return whole
  uniform_N = advantages.uniform_group_rows(rewards_N, group_size, np)
  trained = most(np.where(uniform_N, 0, len_N))
  for share in (4, 2):
    if trained <= whole // share:
      return SplitCapacity(whole, whole // share, min(whole - whole // share + R, slots))
  return whole


def forward_only_values(logp_of, params, batch, group_size: int, streams: int, split: SplitCapacity,
                        prompt_bucket, max_new_tokens: int) -> dict:
  """The step's rows for a SplitCapacity: response_len [N], fwd_only [N] (`forward_only_rows`) and the
  forward-only stream's log-probs and entropy [N, S] from `logp_of` (the step's forward), without gradient,
  0 at prompt positions and at the other rows' responses."""
  len_N = jnp.minimum(batch.response_mask.sum(axis=1), max_new_tokens)
  fwd_only_N = forward_only_rows(batch.rewards, len_N, group_size, streams, split.forward_only, jnp)
  logp, entropy = jax.lax.stop_gradient(logp_of(
      params, batch.tokens, batch.prompt_mask, batch.response_mask, True, prompt_bucket, split.forward_only,
      prompt_positions=False, response_len_N=jnp.where(fwd_only_N, len_N, 0)))
  return {"response_len": len_N, "fwd_only": fwd_only_N, "fwd_logp": logp, "fwd_entropy": entropy}

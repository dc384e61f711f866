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

import numpy as np

from erpo_jax import buckets
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


def uniform_rows(rewards_N: np.ndarray, group_size: int) -> np.ndarray:
  """[N] bool: the rows of groups whose rewards are all equal (the step's own test, on the same float32)."""
  r_BxG = np.asarray(rewards_N, np.float32).reshape(-1, group_size)
  return np.repeat(np.all(r_BxG == r_BxG[:, :1], axis=1), group_size)


def response_capacity(cfg, h, mesh, rewards_N: np.ndarray | None = None) -> int | SplitCapacity | None:
  """Static slots of each packed response stream (all processes agree), or None: no packing.

  Packing runs on one minibatch (a stream crosses rows) and on batch shards
  that hold whole groups: one stream per shard (`logprobs.packed_streams`),
  each with the slots the fullest stream needs. Given this process's rewards (`h`'s rows), and where
  `forward_only_applies`, a batch with uniform groups gets a SplitCapacity.
  """
  if not (cfg.model.shared_prefix and cfg.model.pack_responses and cfg.ppo.minibatches * cfg.ppo.microbatches == 1):
    return None
  R, G = cfg.rollout.max_new_tokens, cfg.rollout.group_size
  len_N = transfer.allgather_rows(np.minimum(h.response_len, R).astype(np.int32)[:, None])[:, 0]
  streams = logprobs.packed_streams(len(len_N) // G, mesh_lib.num_batch_shards(mesh))
  if streams == 0:
    return None
  slots = (len(len_N) // streams) * R
  fits = lambda lengths_N: buckets.packed_capacity(int(lengths_N.reshape(streams, -1).sum(axis=1).max()), slots)
  whole = fits(len_N)
  if rewards_N is None or not forward_only_applies(cfg):
    return whole
  uniform_N = uniform_rows(transfer.allgather_rows(np.asarray(rewards_N, np.float32)[:, None])[:, 0], G)
  if not uniform_N.any():
    return whole
  return SplitCapacity(whole, fits(np.where(uniform_N, 0, len_N)), fits(np.where(uniform_N, len_N, 0)))

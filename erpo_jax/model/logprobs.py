"""Per-token log-probs of token rows under a model: the one entry point for every caller.

Dimension letters: N rows, S sequence length, B prompts, G rows per prompt
(rows group-contiguous: row n holds prompt n // G), P prompt bucket, R response
bucket, C packed response capacity.

`log_probs(...)[:, t] = log P(x_t | x_<t)`; column 0 is 0 (the first token has
no log-prob). The training step (policy, old policy, reference), the reference
prompt cache, the static and dynamic question weights, the Query-KL and
Policy-KL metrics and evaluation all call `log_probs`, so the temperature rule
lives here only:

  prompt positions (t < prompt_len) are scored by the model's own distribution,
  softmax(logits); response positions (t >= prompt_len) at the sampling
  temperature, softmax(logits / T), the distribution the sampler drew from, so
  the PPO ratio compares like with like.

Question NLLs, static and dynamic weights and the Query-KL therefore do not
depend on the sampling temperature, and the cached reference prompt
log-probs equal those the step would compute.

Three layouts give the same values and differ only in the work done:
plain (every row runs its whole sequence), shared prefix (each group's prompt
once: [B, P] + [N, R] tokens) and packed (shared prefix with the responses laid
end to end in C slots, in one stream per batch shard). `choose_layout` picks
the cheapest one that applies.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from erpo_jax.model import shared_prefix
from erpo_jax.model.llama import Transformer
from erpo_jax.model.lm_head import token_log_probs


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a forward lays out its rows; static (hashable), so each value compiles once."""

  group_size: int = 0  # G; 0 = plain rows
  prompt_bucket: int = 0  # P: every prompt_len <= P
  response_bucket: int = 0  # R: every response within R tokens
  capacity: int = 0  # C: packed response slots of each stream; 0 = not packed
  streams: int = 1  # packed streams: stream i packs rows i*N/streams .. (i+1)*N/streams - 1 (whole groups)


PLAIN = Layout()


def packed_streams(groups: int, batch_shards: int) -> int:
  """How many packed streams a batch of `groups` prompts splits into on `batch_shards` batch shards: one per
  shard, each packing that shard's whole groups, or 0 (no packing) when the groups do not split evenly.

  (A stream that spans several shards, or a shard that holds part of a stream, leaves XLA to move the
  stream between devices; with jaxlib 0.10's partitioner it also failed to compile on a data x fsdp x tensor mesh.)
  """
  return batch_shards if batch_shards >= 1 and groups % batch_shards == 0 else 0


def choose_layout(N: int, S: int, *, group_size: int, prompt_bucket: int, response_bucket: int,
                  capacity: int | None = None, streams: int = 1, shared: bool = True) -> Layout:
  """The cheapest layout for N rows of length S.

  Shared prefix needs whole groups and pays off when [B, P] + [N, R] holds
  fewer tokens than [N, S]; packing into `streams` streams of `capacity` slots
  each needs whole groups per stream and a capacity below (N / streams) * R;
  streams = 0 means no packing.
  """
  G, P, R = group_size, min(prompt_bucket, S), min(response_bucket, S)
  if not shared or G < 1 or N % G:
    return PLAIN
  if capacity is not None and streams > 0 and (N // G) % streams == 0 and capacity < (N // streams) * R:
    return Layout(G, P, R, capacity, streams)
  if (N // G) * P + N * R < N * S:
    return Layout(G, P, R)
  return PLAIN


def log_probs(model: Transformer, tokens_NxS: jax.Array, *, prompt_len_N: jax.Array | None = None,
              response_len_N: jax.Array | None = None, temperature: float = 1.0, chunk: int | str = "auto",
              layout: Layout = PLAIN, with_entropy: bool = False, segments_NxS: jax.Array | None = None,
              prompt_grads: bool = True, prompt_positions: bool = True):
  """Next-token log-probs [N, S] float32: at temperature 1 before prompt_len_N, at `temperature` after.

  prompt_len_N is needed unless temperature is 1 (then every position is
  scored alike) and by the shared-prefix layouts; response_len_N by the packed
  one. With `with_entropy` returns (logp, entropy) with the entropy of the same
  distributions in the same layout; else logp.

  segments_NxS (plain layout, temperature 1): sequences laid end to end in
  each row, a segment id per position. Each token sees only the tokens before
  it in its own segment, at RoPE positions that restart at 0 where a segment
  starts, so a sequence's log-probs are those it has in a row of its own. The
  column where a segment starts is scored from the previous segment's last
  position: it means nothing (a first token has no log-prob) and callers skip it.

  prompt_grads=False (shared-prefix and packed layouts): the prompt positions'
  values are the same but carry no gradient, and the backward skips their
  lm-head work; for losses that read only response positions (GRPO's). The
  plain layout interleaves prompts and responses in each row and ignores it.
  prompt_positions=False (the same layouts): the prompt positions are 0 and their lm-head does not run, for
  callers that take them from elsewhere (the cached reference prompt log-probs); the plain layout computes them.
  """
  if prompt_len_N is None and temperature != 1.0:
    raise ValueError("log_probs at a temperature other than 1 needs prompt_len_N: prompts are scored at 1")
  if segments_NxS is not None and (layout.group_size or temperature != 1.0):
    raise ValueError("segments_NxS is for the plain layout at temperature 1")
  if layout.group_size == 0:
    logp, entropy = _plain(model, tokens_NxS, prompt_len_N, temperature=temperature, chunk=chunk,
                           with_entropy=with_entropy, segments_NxS=segments_NxS)
  elif layout.capacity:
    logp, entropy = _packed(model, tokens_NxS, prompt_len_N, response_len_N, layout, temperature=temperature,
                            chunk=chunk, with_entropy=with_entropy, prompt_grads=prompt_grads,
                            prompt_positions=prompt_positions)
  else:
    logp, entropy = shared_prefix.shared_prefix_log_probs(
        model, tokens_NxS, prompt_len_N, layout.group_size, prompt_bucket=layout.prompt_bucket,
        response_bucket=layout.response_bucket, chunk=chunk, temperature=temperature, with_entropy=with_entropy,
        prompt_grads=prompt_grads, prompt_positions=prompt_positions)
  return (logp, entropy) if with_entropy else logp


def _packed(model: Transformer, tokens_NxS: jax.Array, prompt_len_N: jax.Array, response_len_N: jax.Array,
            layout: Layout, *, temperature: float, chunk: int | str, with_entropy: bool, prompt_grads: bool = True,
            prompt_positions: bool = True):
  """The packed layout on `layout.streams` streams: rows [N, ...] -> [streams, N/streams, ...], one packed
  stream of `layout.capacity` slots each (vmapped; on a batch-sharded mesh each shard packs its own rows)."""
  one = lambda tokens, prompt_len, response_len: shared_prefix.packed_log_probs(
      model, tokens, prompt_len, response_len, layout.group_size, prompt_bucket=layout.prompt_bucket,
      response_bucket=layout.response_bucket, capacity=layout.capacity, chunk=chunk, temperature=temperature,
      with_entropy=with_entropy, prompt_grads=prompt_grads, prompt_positions=prompt_positions)
  if layout.streams == 1:
    return one(tokens_NxS, prompt_len_N, response_len_N)
  N, S = tokens_NxS.shape
  split = lambda x: x.reshape(layout.streams, N // layout.streams, *x.shape[1:])
  logp, entropy = jax.vmap(one)(split(tokens_NxS), split(prompt_len_N), split(response_len_N))
  return logp.reshape(N, S), (entropy.reshape(N, S) if with_entropy else None)


def _plain(model: Transformer, tokens_NxS: jax.Array, prompt_len_N: jax.Array | None, *, temperature: float,
           chunk: int | str, with_entropy: bool, segments_NxS: jax.Array | None = None):
  N, S = tokens_NxS.shape
  positions_NxS = None
  if segments_NxS is not None:  # each segment's positions count from its first column
    t_NxS = jnp.broadcast_to(jnp.arange(S), (N, S))
    starts = jnp.concatenate([jnp.ones((N, 1), bool), segments_NxS[:, 1:] != segments_NxS[:, :-1]], axis=1)
    positions_NxS = t_NxS - jax.lax.cummax(jnp.where(starts, t_NxS, 0), axis=1)
  h = model.hidden(tokens_NxS, positions_NxS, segments_NxS=segments_NxS)[:, :-1]  # [N, S-1, D] predicts 1..S-1
  D = h.shape[-1]
  temperature_M = temperature
  if temperature != 1.0:
    t_NxS1 = jnp.arange(1, S)[None, :]
    temperature_M = jnp.where(t_NxS1 < jnp.asarray(prompt_len_N)[:, None], 1.0, temperature).reshape(-1)
  logp, ent = token_log_probs(h.reshape(-1, D), model.unembed_rows(param_dtype=True), tokens_NxS[:, 1:].reshape(-1),
                              chunk=chunk, temperature=temperature_M, with_entropy=with_entropy)
  zero = jnp.zeros((N, 1), jnp.float32)
  logp = jnp.concatenate([zero, logp.reshape(N, S - 1)], axis=1)
  return logp, (jnp.concatenate([zero, ent.reshape(N, S - 1)], axis=1) if with_entropy else None)


def scoring_temperature(sampling_temperature: float) -> float:
  """The temperature log-probs are scored at: the sampler's, and 1 for greedy sampling (T = 0)."""
  return sampling_temperature if sampling_temperature > 0 else 1.0

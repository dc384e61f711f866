"""How the reference pass lays out the training prompts (pure numpy; `reference_pass` runs it).

Two layouts, both computing no padding through the projections:
- packed (`plan_packing`): whole prompts end to end in rows, each attending only
  to itself from RoPE position 0;
- prefix (`plan_prefix_pass`): the tokens every prompt starts with (a chat
  template's system prompt and user header) run once per stream, each prompt's
  own tokens (its suffix) packed after it, attending to the prefix and to itself.
`choose_plan` takes the prefix layout when it computes fewer tokens and no
larger attention than the packed one.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from erpo_jax import buckets

TOKENS_PER_BATCH = 4096  # tokens per forward call of the reference pass
MIN_PREFIX = 2  # the prefix row needs a position that predicts another


def batch_shards(mesh) -> int:
  return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def pack_prompts(lengths: np.ndarray, row_len: int) -> list[list[int]]:
  """Prompt indices laid end to end in rows of `row_len` tokens, best fit decreasing: each prompt, the
  longest first, goes into the open row it leaves the least room in (a new row when none has room)."""
  rows: list[list[int]] = []
  open_rows: list[list[int]] = [[] for _ in range(row_len + 1)]  # open_rows[c]: the rows with c tokens free
  count = np.zeros(row_len + 1, np.int64)
  for q in np.argsort(-lengths, kind="stable"):
    n = int(lengths[q])
    fits = np.flatnonzero(count[n:])
    if fits.size:
      room = n + int(fits[0])
      r = open_rows[room].pop()
      count[room] -= 1
    else:
      room, r = row_len, len(rows)
      rows.append([])
    rows[r].append(int(q))
    open_rows[room - n].append(r)
    count[room - n] += 1
  return rows


def packed_row_length(max_prompt_len: int) -> int:
  """Tokens per packed row of the reference pass: room for the longest prompt, at least 128."""
  return max(128, buckets.fine_bucket(max_prompt_len))


def rows_per_call(rows: int, row_len: int, tokens_per_batch: int, mesh=None) -> int:
  """Packed rows per forward call, a multiple of the mesh's batch shards: as many calls as rows of about
  tokens_per_batch tokens need, the rows spread evenly over them, so the last call is not mostly empty rows."""
  shards = batch_shards(mesh)
  calls = -(-rows // max(1, tokens_per_batch // row_len))
  return buckets.round_up(-(-rows // calls), shards)


@dataclasses.dataclass(frozen=True)
class PackedPass:
  """How the reference pass lays out its prompts: `rows` of prompt indices, `row_len` tokens each, run
  `rows_per_call` rows a forward call."""

  row_len: int
  rows: list[list[int]]
  rows_per_call: int

  @property
  def calls(self) -> int:
    return -(-len(self.rows) // self.rows_per_call)

  @property
  def computed_tokens(self) -> int:
    """Tokens through the projections, MLP and lm-head: every slot of every call's rows."""
    return self.calls * self.rows_per_call * self.row_len

  @property
  def attention_area(self) -> int:
    """Query x key positions of the attention scores (per head): each row over itself."""
    return self.computed_tokens * self.row_len


def plan_packing(lengths: np.ndarray, tokens_per_batch: int = TOKENS_PER_BATCH, mesh=None) -> PackedPass:
  """The packed layout of prompts of these lengths (at least one): rows, their length and rows per call."""
  row_len = packed_row_length(int(lengths.max()))
  rows = pack_prompts(lengths, row_len)
  return PackedPass(row_len, rows, rows_per_call(len(rows), row_len, tokens_per_batch, mesh))


def common_prefix_length(prompt_tokens: list[list[int]]) -> int:
  """Tokens every prompt starts with, at most the shortest prompt's length - 1 (each keeps a token of its own)."""
  if not prompt_tokens:
    return 0
  first = np.asarray(prompt_tokens[0][:max(0, min(len(p) for p in prompt_tokens) - 1)], np.int64)
  c = len(first)
  for ids in prompt_tokens[1:]:
    if c == 0:
      break
    same = np.asarray(ids[:c], np.int64) == first[:c]
    if not same.all():
      c = int(np.argmin(same))
  return c


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
  """How the pass lays out Q prompts sharing `prefix_len` tokens: each call runs `streams` packed streams
  (one per batch shard), each the prefix once and the suffixes of `calls[i][s]` (at most `rows_per_stream`
  prompts, `capacity` slots); a suffix row spans `suffix_bucket` positions in the attention."""

  prefix_len: int
  suffix_bucket: int
  streams: int
  rows_per_stream: int
  capacity: int
  calls: tuple[tuple[tuple[int, ...], ...], ...]

  @property
  def computed_tokens(self) -> int:
    """Tokens through the projections, MLP and lm-head: the prefix and the capacity, per stream and call."""
    return len(self.calls) * self.streams * (self.prefix_len + self.capacity)

  @property
  def attention_area(self) -> int:
    """Query x key positions of the attention scores (per head): each suffix row over the prefix and itself."""
    return len(self.calls) * self.streams * self.rows_per_stream * self.suffix_bucket * (
        self.prefix_len + self.suffix_bucket)


def plan_prefix_pass(lengths: np.ndarray, prefix_len: int, tokens_per_batch: int, mesh=None) -> PrefixPlan:
  """Suffixes (lengths - prefix_len) dealt into calls x streams bins of equal row counts, the longest first
  into the bin with the fewest tokens, so every stream's capacity is near the mean; about `tokens_per_batch`
  suffix tokens a call. Every call has the same shapes: one compile."""
  shards = batch_shards(mesh)
  suffix = np.asarray(lengths, np.int64) - prefix_len
  Q = len(suffix)
  calls = max(1, -(-int(suffix.sum()) // tokens_per_batch))
  bins = calls * shards
  G = -(-Q // bins)
  heap = [(0, b) for b in range(bins)]  # (tokens, bin) of the bins with room
  members: list[list[int]] = [[] for _ in range(bins)]
  load = [0] * bins
  for q in np.argsort(-suffix, kind="stable"):
    _, b = heapq.heappop(heap)
    members[b].append(int(q))
    load[b] += int(suffix[q])
    if len(members[b]) < G:
      heapq.heappush(heap, (load[b], b))
  return PrefixPlan(
      prefix_len=prefix_len, suffix_bucket=buckets.fine_bucket(int(suffix.max())), streams=shards,
      rows_per_stream=G, capacity=buckets.round_up(max(load), 64),
      calls=tuple(tuple(tuple(members[i * shards + s]) for s in range(shards)) for i in range(calls)))


def choose_plan(prompt_tokens: list[list[int]], tokens_per_batch: int, mesh=None,
                shared_prefix: bool = True) -> PackedPass | PrefixPlan:
  """The prefix layout when the prompts share at least MIN_PREFIX tokens and it computes fewer tokens with
  no larger attention than the packed layout; else the packed layout. At least one prompt."""
  lengths = np.array([len(p) for p in prompt_tokens], np.int64)
  packed = plan_packing(lengths, tokens_per_batch, mesh)
  c = common_prefix_length(prompt_tokens) if shared_prefix else 0
  if c < MIN_PREFIX:
    return packed
  prefix = plan_prefix_pass(lengths, c, tokens_per_batch, mesh)
  if prefix.computed_tokens < packed.computed_tokens and prefix.attention_area <= packed.attention_area:
    return prefix
  return packed

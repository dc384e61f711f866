"""Sampler: G responses per prompt from one jitted prefill and one `lax.while_loop` decode.

Dimensions: B prompts, G samples per prompt, N = B*G rows, P prompt bucket,
M = max_new_tokens, S = P + M output and cache length, V vocab, D hidden.

Rows are group-contiguous: row n = b*G + g is sample g of prompt b, so
`x_N.reshape(B, G)` groups a prompt's samples (group advantages rely on it).
Sequences are prompt first, then the response, right-padded with pad_id.
Prompts are padded to power-of-two buckets (>= min_prompt_bucket): one
compile per bucket met.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from erpo_jax import buckets
from erpo_jax.parallel.transfer import allgather_rows
from erpo_jax.errors import DataError
from erpo_jax.model import cpu_kernel
from erpo_jax.model.kv_cache import GroupKVCache
from erpo_jax.rollout.sampling import sample_token, sample_token_columns


@struct.dataclass
class Rollout:
  """N = B*G sampled sequences (row n = b*G + g), each of length S = P + max_new_tokens."""

  tokens: jax.Array  # [N, S] int32: prompt, response, pad_id
  prompt_mask: jax.Array  # [N, S] bool: the prompt's tokens
  response_mask: jax.Array  # [N, S] bool: response tokens incl. the EOS, no padding
  group_id: jax.Array  # [N] int32: b + group_id_offset
  logp: jax.Array  # [N, S] f32: log-prob of each response token under the sampled distribution; 0 elsewhere
  truncated: jax.Array  # [N] bool: no EOS within max_new_tokens
  prompt_len: jax.Array  # [N] int32
  response_len: jax.Array  # [N] int32: response tokens incl. the EOS
  prompt_truncated: jax.Array  # [N] bool: the prompt lost its first tokens (longer than max_prompt_len)


def response_texts(tokens_NxS: np.ndarray, prompt_len_N: np.ndarray, response_len_N: np.ndarray,
                   tokenizer) -> list[str]:
  """The decoded response of each row (host arrays), its EOS tokens left out."""
  eos = set(tokenizer.eos_ids)
  return [tokenizer.decode([t for t in row[p:p + r].tolist() if t not in eos])
          for row, p, r in zip(tokens_NxS, prompt_len_N, response_len_N)]


class Sampler:
  """Batched sampling with a KV cache; the weights (nnx.State or model) come with each `generate` call.

  The jitted prefill and decode are functions of the state (graphdef split off
  once): no weight copy, no retrace as training updates the weights. One
  compile per (P, B, G, greedy).
  """

  def __init__(self, model_graphdef_or_model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, min_prompt_bucket: int = 16, max_prompt_len: int | None = None,
               on_overlong: str = "truncate", mesh=None, data_sharding: NamedSharding | None = None):
    g = model_graphdef_or_model
    self.graphdef = nnx.graphdef(g) if isinstance(g, nnx.Module) else g
    if not (max_new_tokens >= 1 and temperature >= 0 and 0 < top_p <= 1 and top_k >= 0
            and on_overlong in ("truncate", "error") and (max_prompt_len is None or max_prompt_len >= 1)):
      raise ValueError(f"Sampler: expected max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1, top_k >= 0, "
                       f"on_overlong 'truncate'|'error', max_prompt_len >= 1 or None; got {max_new_tokens}, "
                       f"{temperature}, {top_p}, {top_k}, {on_overlong!r}, {max_prompt_len}")
    self.eos_ids = tuple(int(i) for i in tokenizer.eos_ids)
    self.pad_id = int(tokenizer.pad_id)
    self.max_new_tokens = int(max_new_tokens)
    self.temperature = float(temperature)
    self.top_p = float(top_p)
    self.top_k = int(top_k)
    self.min_prompt_bucket = int(min_prompt_bucket)
    self.max_prompt_len = max_prompt_len
    self.on_overlong = on_overlong
    self.overlong_prompts = 0  # prompts cut to max_prompt_len so far
    # The data set's longest prompt, when the caller knows it: prompt buckets cut to its fine bucket.
    self.longest_prompt: int | None = None
    self.traces = 0  # times the prefill or decode was traced (= programs compiled)
    self._batch_sharding = _batch_sharding(mesh, data_sharding)
    self._prefill = jax.jit(self._prefill_fn, static_argnames=("group_size",))
    # The donated cache is the while loop's buffer: no second copy.
    self._decode = jax.jit(self._decode_fn, static_argnames=("greedy",), donate_argnames=("cache",))

  def pad_prompts(self, prompt_tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-pads to the bucket length P; returns (tokens_BxP, len_B, cut_B).

    A prompt over max_prompt_len keeps its LAST max_prompt_len tokens (the end
    holds the question and the assistant header the model continues from), or
    raises DataError with on_overlong='error'.
    """
    if not prompt_tokens:
      raise DataError("sampler: expected at least one prompt, got none")
    rows, cut = [], []
    for i, p in enumerate(prompt_tokens):
      if len(p) == 0:
        raise DataError(f"sampler: prompt {i} is empty; expected at least one token")
      over = self.max_prompt_len is not None and len(p) > self.max_prompt_len
      if over and self.on_overlong == "error":
        raise DataError(f"sampler: prompt {i} has {len(p)} tokens, more than max_prompt_len="
                        f"{self.max_prompt_len}; shorten it or use on_overlong='truncate'")
      rows.append(list(p[-self.max_prompt_len:]) if over else list(p))
      cut.append(over)
    self.overlong_prompts += sum(cut)
    len_B = np.array([len(r) for r in rows], np.int32)
    longest = len_B.max(keepdims=True)
    if jax.process_count() > 1:
      longest = allgather_rows(longest)  # one bucket P on every process
    P = buckets.prompt_bucket(int(longest.max()), self.min_prompt_bucket, self.longest_prompt)
    tokens_BxP = np.full((len(rows), P), self.pad_id, np.int32)
    for b, r in enumerate(rows):
      tokens_BxP[b, :len(r)] = r
    return tokens_BxP, len_B, np.array(cut, bool)

  def generate(self, params_state_or_model, prompt_tokens: list[list[int]], *, group_size: int, key,
               group_id_offset: int = 0, temperature: float | None = None) -> Rollout:
    """G = group_size samples of each of the B prompts -> Rollout with N = B*G rows.

    Same key, same output: decode step t draws with fold_in(key, t). temperature
    overrides the constructor's (0 = greedy); only greedy <-> sampling recompiles.
    On several processes (with a mesh) each passes its own B prompts; the Rollout
    holds all, in process order, b counting over all processes (group_id_offset=0
    gives unique ids); `distributed.global_to_host_local` returns a process's rows.
    """
    if group_size < 1:
      raise ValueError(f"group_size: expected an integer >= 1, got {group_size}")
    state = params_state_or_model
    state = nnx.state(state) if isinstance(state, nnx.Module) else state
    tokens_BxP, len_B, cut_B = self.pad_prompts(prompt_tokens)
    if jax.process_count() > 1:
      # One global batch, process 0's prompts first: each process owns its rows of the mesh.
      tokens_BxP, len_B, cut_B = allgather_rows(tokens_BxP), allgather_rows(len_B), allgather_rows(cut_B)
    temp = self.temperature if temperature is None else max(float(temperature), 0.0)
    cache, logits_NxV = self._prefill(state, tokens_BxP, len_B, group_size=group_size)
    rollout, _ = self._decode(state, cache, logits_NxV, tokens_BxP, len_B, np.repeat(cut_B, group_size), key,
                              jnp.float32(temp if temp > 0 else 1.0), jnp.int32(group_id_offset), greedy=temp == 0)
    return rollout

  # --- device side

  def _constrain(self, x: jax.Array, batch_axis: int) -> jax.Array:
    if self._batch_sharding is None:
      return x
    mesh, axes = self._batch_sharding
    shards = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)) if a]))
    if x.shape[batch_axis] % shards:
      # Fewer prompts than batch shards: every device prefills them all (N = B*G rows are sharded).
      return x
    spec = [None] * x.ndim
    spec[batch_axis] = axes
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

  def _prefill_fn(self, state, tokens_BxP, len_B, *, group_size):
    """Prefills each prompt once; returns its cache, held once per prompt (`GroupKVCache`: the G rows b*G + g
    read prompt b's keys and values), and its last logits repeated G times.

    The cache's slots: the prompt in [0, P), decode token t in P + t (a response slot of each row).
    """
    self.traces += 1
    model = nnx.merge(self.graphdef, state)
    tokens_BxP = self._constrain(tokens_BxP, 0)
    h_BxPxD, cache = model.prefill(tokens_BxP, tokens_BxP.shape[1])
    h_Bx1xD = jnp.take_along_axis(h_BxPxD, (len_B - 1)[:, None, None], axis=1)
    logits_BxV = model.logits(h_Bx1xD)[:, 0]
    # On one CPU device in float32 the decode kernel writes and attends: its form of the same cache.
    grouped = cpu_kernel.GroupCache.for_groups if cpu_kernel.usable(model.dtype) else GroupKVCache.for_groups
    cache = [jax.tree.map(lambda x: self._constrain(x, 0), grouped(c, group_size, self.max_new_tokens)) for c in cache]
    return cache, self._constrain(jnp.repeat(logits_BxV, group_size, axis=0), 0)

  def _decode_fn(self, state, cache, logits_NxV, tokens_BxP, len_B, cut_N, key, temperature, group_id_offset,
                 *, greedy):
    """Samples the first token from the prefill logits, then decodes until all rows hit EOS or M tokens.

    Returns (Rollout, the final cache); the caller drops the cache.
    """
    self.traces += 1
    model = nnx.merge(self.graphdef, state)
    M = self.max_new_tokens
    N = logits_NxV.shape[0]
    B, P = tokens_BxP.shape
    G = N // B
    len_N = jnp.repeat(len_B, G)
    eos = jnp.asarray(self.eos_ids, jnp.int32)
    opts = dict(greedy=greedy, top_k=self.top_k, top_p=self.top_p)
    tok_N, logp_N = sample_token(logits_NxV, jax.random.fold_in(key, 0), temperature, **opts)
    resp_NxM = self._constrain(jnp.full((N, M), self.pad_id, jnp.int32).at[:, 0].set(tok_N), 0)
    resp_logp_NxM = self._constrain(jnp.zeros((N, M), jnp.float32).at[:, 0].set(logp_N), 0)
    done_N = jnp.isin(tok_N, eos)

    def cond(carry):
      t, _, _, _, done_N, _ = carry
      return (t < M - 1) & ~jnp.all(done_N)

    layers, unembed_VxD = model.decode_layers(), model.decode_unembed()
    slot_T = jnp.arange(P + M)

    def body(carry):
      # Token t (already drawn) goes in at RoPE position len + t and cache slot P + t; its output
      # draws token t + 1. A row attends to its prompt [0, len) and to slots [P, P + t].
      t, tok_N, resp_NxM, resp_logp_NxM, done_N, cache = carry
      attend_NxT = (slot_T[None] < len_N[:, None]) | ((slot_T[None] >= P) & (slot_T[None] <= P + t))
      hT_DxN, cache = model.decode_columns(tok_N, len_N + t, P + t, attend_NxT, cache, layers)
      logits_VxN = model.logits_columns(hT_DxN, unembed_VxD)
      nxt_N, logp_N = sample_token_columns(logits_VxN, jax.random.fold_in(key, t + 1), temperature, **opts)
      live_N = ~done_N
      nxt_N = jnp.where(live_N, nxt_N, self.pad_id)
      logp_N = jnp.where(live_N, logp_N, 0.0)
      resp_NxM = jax.lax.dynamic_update_slice(resp_NxM, nxt_N[:, None], (0, t + 1))
      resp_logp_NxM = jax.lax.dynamic_update_slice(resp_logp_NxM, logp_N[:, None], (0, t + 1))
      return t + 1, nxt_N, resp_NxM, resp_logp_NxM, done_N | (live_N & jnp.isin(nxt_N, eos)), cache

    carry = (jnp.int32(0), tok_N, resp_NxM, resp_logp_NxM, done_N, cache)
    _, _, resp_NxM, resp_logp_NxM, done_N, cache = jax.lax.while_loop(cond, body, carry)

    # Response length: up to and including the first EOS, else M.
    resp_len_N = jnp.where(done_N, jnp.argmax(jnp.isin(resp_NxM, eos), axis=1) + 1, M).astype(jnp.int32)
    # Place the response right after each prompt: column s holds response token s - len.
    S = P + M
    j_NxS = jnp.arange(S)[None, :] - len_N[:, None]
    in_resp_NxS = (j_NxS >= 0) & (j_NxS < resp_len_N[:, None])
    j_NxS = jnp.clip(j_NxS, 0, M - 1)
    prompt_NxS = jnp.pad(jnp.repeat(tokens_BxP, G, axis=0), ((0, 0), (0, M)), constant_values=self.pad_id)
    prompt_mask_NxS = jnp.arange(S)[None, :] < len_N[:, None]
    tokens_NxS = jnp.where(prompt_mask_NxS, prompt_NxS,
                           jnp.where(in_resp_NxS, jnp.take_along_axis(resp_NxM, j_NxS, axis=1), self.pad_id))
    logp_NxS = jnp.where(in_resp_NxS, jnp.take_along_axis(resp_logp_NxM, j_NxS, axis=1), 0.0)
    group_id_N = (jnp.repeat(jnp.arange(B, dtype=jnp.int32), G) + group_id_offset).astype(jnp.int32)
    rollout = Rollout(tokens=tokens_NxS.astype(jnp.int32), prompt_mask=prompt_mask_NxS, response_mask=in_resp_NxS,
                      group_id=group_id_N, logp=logp_NxS, truncated=~done_N, prompt_len=len_N.astype(jnp.int32),
                      response_len=resp_len_N, prompt_truncated=cut_N)
    # Rows stay batch-sharded, so each process can read back just its own rows.
    rollout = jax.tree.map(lambda x: self._constrain(x, 0), rollout)
    # Returning the cache lets XLA alias it to the donated input: the loop runs in those buffers.
    return rollout, cache


def _batch_sharding(mesh, data_sharding: NamedSharding | None):
  """(mesh, mesh axes of the batch dim) or None; the batch dim spans ('data', 'fsdp') by default."""
  if data_sharding is not None:
    return data_sharding.mesh, data_sharding.spec[0]
  return None if mesh is None else (mesh, tuple(a for a in ("data", "fsdp") if a in mesh.axis_names))


def greedy_reference(model: nnx.Module, prompt_tokens: list[list[int]], n: int) -> list[list[int]]:
  """n greedy tokens per prompt by a plain loop of full forwards (no cache, no EOS stop).

  Each step runs the right-padded batch [B, Lmax + n] (one compile) and takes
  argmax of the logits at position len_b - 1 + t; causality hides the padding.
  """
  graphdef, state = nnx.split(model)
  B = len(prompt_tokens)
  len_B = np.array([len(p) for p in prompt_tokens], np.int32)
  tokens = np.zeros((B, int(len_B.max()) + n), np.int32)
  for b, p in enumerate(prompt_tokens):
    tokens[b, :len(p)] = p

  @jax.jit
  def step(state, tokens_BxS, pos_B):
    m = nnx.merge(graphdef, state)
    h_Bx1xD = jnp.take_along_axis(m.hidden(tokens_BxS), pos_B[:, None, None], axis=1)
    return jnp.argmax(m.logits(h_Bx1xD)[:, 0], axis=-1).astype(jnp.int32)

  out = np.zeros((B, n), np.int32)
  for t in range(n):
    nxt = np.asarray(step(state, tokens, len_B - 1 + t))
    tokens[np.arange(B), len_B + t] = nxt
    out[:, t] = nxt
  return out.tolist()

"""The reference pass: every training prompt's per-token log-probs under the reference model.

`compute_reference_logp` runs the layout `reference_layout.choose_plan` picks:
whole prompts packed end to end (`packed_pass_logp`), or the prompts' common
prefix once per stream with their own tokens packed after it
(`prefix_pass_logp`, the update's packed shared-prefix layout with one group
per stream). Under causal attention the prefix's hidden states, keys and values
do not depend on what follows, so both give each prompt the log-probs it has
alone, position by position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from erpo_jax.data import reference_layout
from erpo_jax.data.reference_layout import TOKENS_PER_BATCH, PackedPass, PrefixPlan
from erpo_jax.model import logprobs
from erpo_jax.parallel import mesh as mesh_lib


def compute_reference_logp(model, prompt_tokens: list[list[int]], *, tokens_per_batch: int = TOKENS_PER_BATCH,
                           mesh=None, chunk: int | str = "auto", progress: bool = True, shared_prefix: bool = True
                           ) -> tuple[np.ndarray, np.ndarray]:
  """Reference per-token prompt log-probs [Q, Lmax] (0 at t = 0 and past each prompt) and prompt lengths [Q].

  Each call runs the same shapes of about `tokens_per_batch` tokens, so the
  pass compiles once. shared_prefix=False keeps to whole prompts (the packed
  layout) whatever the prompts share.
  """
  Q = len(prompt_tokens)
  lengths = np.array([len(p) for p in prompt_tokens], np.int32)
  out = np.zeros((Q, int(lengths.max()) if Q else 1), np.float32)
  if Q == 0:
    return out, lengths
  plan = reference_layout.choose_plan(prompt_tokens, tokens_per_batch, mesh, shared_prefix)
  bar = tqdm(total=Q, desc="reference pass", unit="prompt") if progress and jax.process_index() == 0 else None
  on_call = bar.update if bar is not None else None
  if isinstance(plan, PrefixPlan):
    prefix_pass_logp(model, prompt_tokens, plan, out, mesh=mesh, chunk=chunk, on_call=on_call)
  else:
    packed_pass_logp(model, prompt_tokens, plan, out, mesh=mesh, chunk=chunk, on_call=on_call)
  if bar is not None:
    bar.close()
  return out, lengths


def _gathered(lp) -> np.ndarray:
  if jax.process_count() > 1:
    lp = multihost_utils.process_allgather(lp, tiled=True)
  return np.asarray(jax.device_get(lp))


def packed_pass_logp(model, prompt_tokens: list[list[int]], plan: PackedPass, out_QxL: np.ndarray, *,
                     mesh=None, chunk: int | str = "auto", on_call=None) -> None:
  """Writes out_QxL[q, 1:n_q] with whole prompts packed in rows of `plan.row_len` tokens, each prompt attending
  only to itself from RoPE position 0 (`logprobs.log_probs` with segments), so no padding is computed.
  on_call(prompts) is told how many prompts each call scored."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, tokens, segments):  # prompts: temperature 1
    return logprobs.log_probs(nnx.merge(graphdef, state), tokens, chunk=chunk, segments_NxS=segments)

  rows, row_len, R = plan.rows, plan.row_len, plan.rows_per_call
  for start in range(0, len(rows), R):
    tok = np.zeros((R, row_len), np.int32)
    seg = np.full((R, row_len), -1, np.int32)  # -1: the free end of a row
    places = []  # (prompt, row, offset)
    for r, row in enumerate(rows[start:start + R]):
      offset = 0
      for q in row:
        n = len(prompt_tokens[q])
        tok[r, offset:offset + n] = prompt_tokens[q]
        seg[r, offset:offset + n] = q
        places.append((q, r, offset))
        offset += n
    lp = _gathered(fwd(state, _to_device(tok, mesh), _to_device(seg, mesh)))
    for q, r, offset in places:
      n = len(prompt_tokens[q])
      out_QxL[q, 1:n] = lp[r, offset + 1:offset + n]
    if on_call is not None:
      on_call(len(places))


def _to_device(x: np.ndarray, mesh):
  if mesh is None:
    return jnp.asarray(x)
  return jax.make_array_from_callback(x.shape, mesh_lib.batch_sharding(mesh, x.ndim), lambda i: x[i])


def prefix_pass_logp(model, prompt_tokens: list[list[int]], plan: PrefixPlan, out_QxL: np.ndarray, *,
                     mesh=None, chunk: int | str = "auto", on_call=None) -> None:
  """Writes out_QxL[q, 1:n_q] = log P_ref(x_t | x_<t) of every prompt, laid out as `plan` says.
  on_call(prompts) is told how many prompts each call scored."""
  c, R, G = plan.prefix_len, plan.suffix_bucket, plan.rows_per_stream
  N, S = plan.streams * G, c + R
  layout = logprobs.Layout(group_size=G, prompt_bucket=c, response_bucket=R, capacity=plan.capacity,
                           streams=plan.streams)
  graphdef, state = nnx.split(model)

  @jax.jit
  def fwd(state, tokens_NxS, prompt_len_N, suffix_len_N):  # prompts: temperature 1
    return logprobs.log_probs(nnx.merge(graphdef, state), tokens_NxS, prompt_len_N=prompt_len_N,
                              response_len_N=suffix_len_N, chunk=chunk, layout=layout)

  prefix = np.asarray(prompt_tokens[0][:c], np.int32)
  prompt_len_N = np.full(N, c, np.int32)
  for call in plan.calls:
    tok = np.zeros((N, S), np.int32)
    tok[:, :c] = prefix
    suffix_len_N = np.zeros(N, np.int32)  # rows past a stream's prompts: the prefix alone
    places = [(q, s * G + j) for s, stream in enumerate(call) for j, q in enumerate(stream)]
    for q, n in places:
      ids = prompt_tokens[q]
      tok[n, c:len(ids)] = ids[c:]
      suffix_len_N[n] = len(ids) - c
    lp = _gathered(fwd(state, *(_to_device(x, mesh) for x in (tok, prompt_len_N, suffix_len_N))))
    for q, n in places:
      L = len(prompt_tokens[q])
      out_QxL[q, 1:L] = lp[n, 1:L]
    if on_call is not None:
      on_call(len(places))

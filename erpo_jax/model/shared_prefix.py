"""Training log-probs that run each group's shared prompt once: [B, P] prompt rows, [N, R] response rows.

Dimension letters: B prompts, G rows per prompt, N = B*G rows (group-contiguous:
row n belongs to prompt n // G), S sequence length, P prompt bucket, R response
bucket, L layers, D hidden, H query heads, K key/value heads, Dh head dim.

The G rows of a group hold the same prompt, so its hidden states and keys /
values are computed once, on B prompt rows, and the N response rows attend to
them. The result equals `logprobs.log_probs` on the plain [N, S] layout at every
position t >= 1 with t < prompt_len + R; the prompt log-probs are broadcast to
the G rows, so their gradient sums over the group exactly as the G copies of
the plain layout do. Prompt work drops from N*P to B*P tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from erpo_jax.model.group_attention import group_attention
from erpo_jax.model.llama import Transformer, attention, dense, rope_tables
from erpo_jax.model.lm_head import token_log_probs


def shared_prefix_hidden(model: Transformer, tokens_NxS: jax.Array, prompt_len_N: jax.Array, group_size: int, *,
                         prompt_bucket: int, response_bucket: int):
  """Final-normed hidden states of the B prompt rows [B, P, D] and the N response rows [N, R, D].

  Prompt row b holds tokens[b*G, :P] at positions 0..P-1 (causal). Response
  row n holds tokens[n, len_n + r] at its true RoPE position len_n + r, for
  r < R (positions past S repeat the last token; they come after every valid
  query, so the causal mask keeps them out). Returns (hp_BxPxD, hr_NxRxD,
  tokens_BxP, response_tokens_NxR).
  """
  g = group_layout(model, tokens_NxS, prompt_len_N, group_size, prompt_bucket, response_bucket)
  cos_r, sin_r = rope_tables(g.pos_NxR, model.cfg)

  def layer(carry, p):
    hp, hr = carry
    qr, kr, vr = model._qkv(hr, p, cos_r, sin_r)
    hp, kp, vp = g.prompt_layer(model, hp, p)
    hr = hr + dense(group_attention(qr, kp, vp, kr, vr, g.len_B, g.G), p["wo"].astype(model.dtype), 2)
    return (hp, hr + model._mlp(hr, p)), None

  h0 = (model.embed_tokens(g.tokens_BxP), model.embed_tokens(g.tokens_NxR))
  (hp, hr), _ = jax.lax.scan(model.rematerialised(layer), h0, model._layer_params())
  return model.final_hidden(hp), model.final_hidden(hr), g.tokens_BxP, g.tokens_NxR


class GroupLayout(NamedTuple):
  """What both training layouts derive from group-contiguous rows: B prompt rows of P tokens
  (each group's prompt once) and N response rows of R tokens at their true positions."""

  G: int
  len_N: jax.Array  # [N] prompt lengths
  len_B: jax.Array  # [B]
  tokens_BxP: jax.Array
  pos_NxR: jax.Array  # len_n + r
  tokens_NxR: jax.Array  # tokens[n, len_n + r]; positions past S repeat the last token
  rope_p: tuple[jax.Array, jax.Array]  # cos, sin of the prompt rows

  def prompt_layer(self, model: Transformer, hp_BxPxD, p):
    """One layer on the prompt rows: (next hp, their keys, their values) for the responses."""
    qp, kp, vp = model._qkv(hp_BxPxD, p, *self.rope_p)
    P = hp_BxPxD.shape[1]
    o = attention(qp, kp, vp, jnp.tril(jnp.ones((P, P), bool))[None])
    hp = hp_BxPxD + dense(o, p["wo"].astype(model.dtype), 2)
    return hp + model._mlp(hp, p), kp, vp


def last_prompt_hidden(hp_BxPxD: jax.Array, prompt_len_N: jax.Array, G: int) -> jax.Array:
  """[B, D]: the hidden state at each prompt's last token, which predicts the first response token."""
  B, P = hp_BxPxD.shape[:2]
  last_B = jnp.clip(prompt_len_N.astype(jnp.int32).reshape(B, G)[:, 0] - 1, 0, P - 1)
  return jnp.take_along_axis(hp_BxPxD, last_B[:, None, None], axis=1)[:, 0]


def group_layout(model: Transformer, tokens_NxS, prompt_len_N, G: int, prompt_bucket: int,
                 response_bucket: int) -> GroupLayout:
  N, S = tokens_NxS.shape
  if N % G:
    raise ValueError(f"shared prefix: {N} rows are not whole groups of {G}")
  B, P, R = N // G, min(prompt_bucket, S), min(response_bucket, S)
  len_N = prompt_len_N.astype(jnp.int32)
  pos_NxR = len_N[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]
  return GroupLayout(
      G=G, len_N=len_N, len_B=len_N.reshape(B, G)[:, 0], tokens_BxP=tokens_NxS.reshape(B, G, S)[:, 0, :P],
      pos_NxR=pos_NxR, tokens_NxR=jnp.take_along_axis(tokens_NxS, jnp.minimum(pos_NxR, S - 1), axis=1),
      rope_p=rope_tables(jnp.broadcast_to(jnp.arange(P), (B, P)), model.cfg))


def shared_prefix_log_probs(model: Transformer, tokens_NxS: jax.Array, prompt_len_N: jax.Array, group_size: int,
                            *, prompt_bucket: int, response_bucket: int, chunk: int | str = "auto",
                            temperature: float = 1.0, with_entropy: bool = False, prompt_grads: bool = True,
                            prompt_positions: bool = True):
  """`logprobs.log_probs` of group-contiguous rows sharing their prompt, the prompt run once per group.

  out[n, t] = log P(x_t | x_<t) for 1 <= t < len_n + R (len_n = prompt_len_N[n]);
  0 at t = 0 and from len_n + R on. Positions 1..len_n-1 come from prompt row
  n // G, t = len_n from that row's hidden state at len_n - 1, later ones from
  response row n. Requires prompt_len <= P = min(prompt_bucket, S), every
  response within R = min(response_bucket, S) tokens, and the G rows of a group
  to hold the same prompt tokens; P and R are static. Prompt positions are
  scored at temperature 1, response positions at `temperature` (the rule of
  model.logprobs). Returns [N, S] float32 log-probs, and the entropy in the
  same layout with `with_entropy` (else None). prompt_grads=False: the prompt
  positions' values carry no gradient and their lm-head backward is not run;
  prompt_positions=False: they are 0 and their lm-head does not run at all (`_head_log_probs`).
  """
  N, S = tokens_NxS.shape
  G = group_size
  hp, hr, tokens_BxP, tokens_NxR = shared_prefix_hidden(
      model, tokens_NxS, prompt_len_N, G, prompt_bucket=prompt_bucket, response_bucket=response_bucket)
  (B, P, D), R = hp.shape, tokens_NxR.shape[1]
  len_N = prompt_len_N.astype(jnp.int32)
  h_last_NxD = jnp.repeat(last_prompt_hidden(hp, len_N, G), G, axis=0)
  # Response row n predicts its R tokens from [h at len_n - 1, hr[:, :R-1]].
  h_in_NxRxD = jnp.concatenate([h_last_NxD[:, None], hr[:, :-1]], axis=1)
  logp_M, ent_M = _head_log_probs(model, hp[:, :-1].reshape(-1, D), tokens_BxP[:, 1:].reshape(-1),
                                  h_in_NxRxD.reshape(-1, D), tokens_NxR.reshape(-1), chunk=chunk,
                                  temperature=temperature, with_entropy=with_entropy, prompt_grads=prompt_grads,
                                  prompt_positions=prompt_positions)
  logp = _to_rows(logp_M, len_N, B, G, P, R, S)
  return logp, (_to_rows(ent_M, len_N, B, G, P, R, S) if with_entropy else None)


def _head_log_probs(model: Transformer, h_prompt_MpxD: jax.Array, targets_prompt_Mp: jax.Array,
                    h_response_MrxD: jax.Array, targets_response_Mr: jax.Array, *, chunk: int | str,
                    temperature: float, with_entropy: bool, prompt_grads: bool, prompt_positions: bool = True):
  """The lm-head's log-probs (and entropy) of the [prompt | response] stream [Mp + Mr]: prompt positions at
  temperature 1, responses at `temperature`.

  prompt_grads=False: the prompt positions' values carry no gradient (a loss that reads only response
  positions, as GRPO's does), so they run as a chunk loop of their own outside the differentiation and the
  backward recomputes and differentiates only the response chunks. The values are the same either way.
  prompt_positions=False: their values are 0 and no lm-head work is done for them.
  """
  w_VxD = model.unembed_rows(param_dtype=True)
  Mp, Mr = h_prompt_MpxD.shape[0], h_response_MrxD.shape[0]
  if prompt_grads and prompt_positions:
    temperature_M = jnp.concatenate([jnp.ones((Mp,), jnp.float32), jnp.full((Mr,), temperature, jnp.float32)])
    return token_log_probs(jnp.concatenate([h_prompt_MpxD, h_response_MrxD]), w_VxD,
                           jnp.concatenate([targets_prompt_Mp, targets_response_Mr]), chunk=chunk,
                           temperature=temperature_M, with_entropy=with_entropy)
  sg = jax.lax.stop_gradient
  logp_p, ent_p = (token_log_probs(sg(h_prompt_MpxD), sg(w_VxD), targets_prompt_Mp, chunk=chunk,
                                   with_entropy=with_entropy) if prompt_positions else (jnp.zeros((Mp,)),) * 2)
  logp_r, ent_r = token_log_probs(h_response_MrxD, w_VxD, targets_response_Mr, chunk=chunk,
                                  temperature=temperature, with_entropy=with_entropy)
  return jnp.concatenate([logp_p, logp_r]), (jnp.concatenate([ent_p, ent_r]) if with_entropy else None)


def _to_rows(values_M: jax.Array, len_N: jax.Array, B: int, G: int, P: int, R: int, S: int) -> jax.Array:
  """[B*(P-1) prompt values | N*R response values] -> the plain [N, S] layout (gathers, so grads sum)."""
  N = B * G
  prompt_BxP = jnp.pad(values_M[:B * (P - 1)].reshape(B, P - 1), ((0, 0), (1, S - P)))  # column t = position t
  prompt_NxS = jnp.repeat(prompt_BxP, G, axis=0)  # the G copies of a prompt; its gradient sums them
  response_NxR = values_M[B * (P - 1):].reshape(N, R)
  t_NxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (N, S))
  r_NxS = t_NxS - len_N[:, None]
  response_NxS = jnp.take_along_axis(response_NxR, jnp.clip(r_NxS, 0, R - 1), axis=1)
  out = jnp.where(r_NxS < 0, prompt_NxS, jnp.where(r_NxS < R, response_NxS, 0.0))
  return jnp.where(t_NxS >= 1, out, 0.0)


# ---------------------------------------------------------------------- packed responses
#
# C is a static token capacity >= the batch's response tokens. Response token r
# of row n sits at stream slot start_n + r (start_n = tokens of rows before n):
# the per-token work (norms, projections, MLP, lm-head) runs on C slots instead
# of N*R, and only attention sees the [N, R] layout, gathered per layer.


def stream_index(response_len_N: jax.Array, R: int, C: int) -> tuple[jax.Array, jax.Array]:
  """(idx_K, inv_C), K = N*R: idx_K[n*R + r] = stream slot of response token r of row n, or C for
  padding (r >= its length); inv_C[c] = n*R + r of the token in slot c, or K for an unused slot."""
  N = response_len_N.shape[0]
  len_N = jnp.minimum(response_len_N.astype(jnp.int32), R)
  start_N = jnp.cumsum(len_N) - len_N
  r = jnp.arange(R, dtype=jnp.int32)
  idx_NxR = jnp.where(r[None, :] < len_N[:, None], start_N[:, None] + r[None, :], C)
  inv_C = jnp.full((C + 1,), N * R, jnp.int32).at[idx_NxR.reshape(-1)].set(jnp.arange(N * R, dtype=jnp.int32))
  return idx_NxR.reshape(-1), inv_C[:C]


@jax.custom_vjp
def take_rows(x_MxF: jax.Array, idx_K: jax.Array, inv_M: jax.Array) -> jax.Array:
  """y[k] = x[idx[k]], zero where idx[k] == M. idx and inv are inverse partial maps (each row of x
  is taken at most once, by k = inv[m], else inv[m] == K), so the gradient is a gather too, not a
  scatter-add."""
  zero = jnp.zeros((1,) + x_MxF.shape[1:], x_MxF.dtype)
  return jnp.take(jnp.concatenate([x_MxF, zero]), idx_K, axis=0)


def _take_rows_fwd(x, idx, inv):
  return take_rows(x, idx, inv), (idx, inv)


def _take_rows_bwd(res, dy):
  idx, inv = res
  return take_rows(dy, inv, idx), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def packed_hidden(model: Transformer, tokens_NxS: jax.Array, prompt_len_N: jax.Array, response_len_N: jax.Array,
                  group_size: int, *, prompt_bucket: int, response_bucket: int, capacity: int):
  """`shared_prefix_hidden` with the response tokens packed into C = capacity stream slots.

  Returns (hp_BxPxD, hs_CxD, tokens_BxP, tokens_C, idx_K, inv_C). Requires
  sum(min(response_len, R)) <= C; slots past that hold token 0 and are ignored.
  """
  N = tokens_NxS.shape[0]
  g = group_layout(model, tokens_NxS, prompt_len_N, group_size, prompt_bucket, response_bucket)
  R, C = g.tokens_NxR.shape[1], capacity
  idx_K, inv_C = stream_index(response_len_N, R, C)
  tokens_C = jnp.take(jnp.append(g.tokens_NxR.reshape(-1), 0), inv_C)
  pos_C = jnp.take(jnp.append(g.pos_NxR.reshape(-1), 0), inv_C)
  # The stream stays 2-D, [C, D]: XLA's CPU reductions over a [1, C, D] array (the norms and their weight
  # gradients) run 10-30x slower than over the same [C, D] one.
  cos_s, sin_s = (x[0] for x in rope_tables(pos_C[None], model.cfg))  # [C, 1, Dh]
  to_rows = lambda x_CxHxDh: take_rows(x_CxHxDh.reshape(C, -1), idx_K, inv_C).reshape(N, R, *x_CxHxDh.shape[1:])

  def layer(carry, p):
    hp, hs = carry  # [B, P, D], [C, D]
    qs, ks, vs = model._qkv(hs, p, cos_s, sin_s)
    hp, kp, vp = g.prompt_layer(model, hp, p)
    o_NxRxHxDh = group_attention(to_rows(qs), kp, vp, to_rows(ks), to_rows(vs), g.len_B, g.G)
    o_CxHxDh = take_rows(o_NxRxHxDh.reshape(N * R, -1), inv_C, idx_K).reshape(C, *qs.shape[1:])
    hs = hs + dense(o_CxHxDh, p["wo"].astype(model.dtype), 2)
    return (hp, hs + model._mlp(hs, p)), None

  h0 = (model.embed_tokens(g.tokens_BxP), model.embed_tokens(tokens_C))
  (hp, hs), _ = jax.lax.scan(model.rematerialised(layer), h0, model._layer_params())
  return model.final_hidden(hp), model.final_hidden(hs), g.tokens_BxP, tokens_C, idx_K, inv_C


def packed_log_probs(model: Transformer, tokens_NxS: jax.Array, prompt_len_N: jax.Array, response_len_N: jax.Array,
                     group_size: int, *, prompt_bucket: int, response_bucket: int, capacity: int,
                     chunk: int | str = "auto", temperature: float = 1.0, with_entropy: bool = False,
                     prompt_grads: bool = True, prompt_positions: bool = True):
  """`shared_prefix_log_probs` on packed responses: the same values at prompt positions and at the
  response tokens (t < len_n + response_len_n), 0 after them. Needs sum(response_len) <= capacity."""
  N, S = tokens_NxS.shape
  G = group_size
  hp, hs, tokens_BxP, tokens_C, idx_K, inv_C = packed_hidden(
      model, tokens_NxS, prompt_len_N, response_len_N, G, prompt_bucket=prompt_bucket,
      response_bucket=response_bucket, capacity=capacity)
  B, P, D = hp.shape
  R = idx_K.shape[0] // N
  len_N = prompt_len_N.astype(jnp.int32)
  h_last_BxD = last_prompt_hidden(hp, len_N, G)
  # Slot c holds token r of row n; it is predicted by slot c - 1 (token r - 1), or at r = 0 by
  # the prompt's last hidden state.
  row_C, r_C = jnp.minimum(inv_C // R, N - 1), inv_C % R
  prev_CxD = jnp.concatenate([jnp.zeros((1, D), hs.dtype), hs[:-1]])
  h_in_CxD = jnp.where((r_C == 0)[:, None], jnp.take(h_last_BxD, row_C // G, axis=0), prev_CxD)
  split = B * (P - 1)
  logp_M, ent_M = _head_log_probs(model, hp[:, :-1].reshape(-1, D), tokens_BxP[:, 1:].reshape(-1), h_in_CxD,
                                  tokens_C, chunk=chunk, temperature=temperature, with_entropy=with_entropy,
                                  prompt_grads=prompt_grads, prompt_positions=prompt_positions)

  def to_layout(values_M):
    response_K = take_rows(values_M[split:, None], idx_K, inv_C)[:, 0]
    return _to_rows(jnp.concatenate([values_M[:split], response_K]), len_N, B, G, P, R, S)

  return to_layout(logp_M), (to_layout(ent_M) if with_entropy else None)

"""ERPO/GRPO loss (SPEC sections 4-5): the clipped ratio term weighted per question plus a masked KL penalty.

Dimension letters: N rows (sequences), S sequence length. Every function is
pure (arrays and static scalars/strings in, arrays out) and meant to be traced
inside the one jitted train step. Column 0 of a log-prob mask is ignored
(kl.scored_mask). Losses are kept as (sum, count) until one final division so
minibatches, accumulation steps and hosts combine exactly: sum the sums, sum
the counts, divide once (`ratio`). Statistics that are only logged live in
`algo.diagnostics`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from erpo_jax.algo.kl import scored_mask, token_kl

Aggregation = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"]
KLOn = Literal["prompt", "response", "all", "none"]
RATIO_LOG_CLAMP = 20.0  # SPEC 4: ratio = exp(clip(logp - old, -20, 20))
_KL_AGGREGATION = {"row-mean": "seq-mean-token-mean", "token-mean": "token-mean"}


def ratio(total: jax.Array, count: jax.Array) -> jax.Array:
  """total / count, and 0 where count is 0 (an empty batch or mask)."""
  return jnp.where(count > 0, total / jnp.where(count > 0, count, 1), 0.0)


def aggregate(values_NxS: jax.Array, mask_NxS: jax.Array, mode: Aggregation) -> tuple[jax.Array, jax.Array]:
  """(sum, count) of masked per-token values; the loss is ratio(sum, count).

  seq-mean-token-mean: (sum_i mean_{t in M_i} v_t, #rows with |M_i| > 0)
  token-mean:          (sum_i sum_{t in M_i} v_t,  sum_i |M_i|)
  seq-mean-token-sum:  (sum_i sum_{t in M_i} v_t,  #rows with |M_i| > 0)
  Rows with no masked token (padding rows) count in neither piece. The mask
  is used as given (no column-0 rule): values are already per-token.
  """
  mask_NxS = jnp.asarray(mask_NxS, bool)
  sum_N = jnp.where(mask_NxS, values_NxS, 0.0).sum(axis=1)
  count = aggregate_count(mask_NxS, mode).astype(sum_N.dtype)
  if mode == "seq-mean-token-mean":
    return (sum_N / jnp.maximum(mask_NxS.sum(axis=1), 1)).sum(), count
  return sum_N.sum(), count


def aggregate_count(mask_NxS: jax.Array, mode: Aggregation) -> jax.Array:
  """The count piece of `aggregate`, without values: compute it on the whole update batch."""
  tokens_N = jnp.asarray(mask_NxS, bool).sum(axis=1)
  if mode == "token-mean":
    return tokens_N.sum().astype(jnp.float32)
  if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
    return (tokens_N > 0).sum().astype(jnp.float32)
  raise ValueError(f"loss aggregation must be one of {Aggregation.__args__}, got {mode!r}")


def kl_mask(prompt_mask_NxS: jax.Array, response_mask_NxS: jax.Array, kl_on: KLOn) -> jax.Array:
  """The scored tokens the penalty covers: prompt (ERPO), response (GRPO), all, or none."""
  prompt_NxS, response_NxS = scored_mask(prompt_mask_NxS), scored_mask(response_mask_NxS)
  masks = {"prompt": prompt_NxS, "response": response_NxS, "all": prompt_NxS | response_NxS,
           "none": jnp.zeros_like(prompt_NxS)}
  if kl_on not in masks:
    raise ValueError(f"kl_on must be one of {sorted(masks)}, got {kl_on!r}")
  return masks[kl_on]


def penalises_prompt(kl_on: KLOn) -> bool:
  """Whether the penalty `kl_mask` selects covers prompt tokens: the one way the loss reads prompt positions
  (the step skips their lm-head backward otherwise)."""
  return kl_on in ("prompt", "all")


class Denominators(NamedTuple):
  """Counts of the whole update batch; erpo_loss divides each minibatch's sums by them.

  float32, exact up to 2^24 (16.7M) tokens per update batch.
  """

  pg_count: jax.Array  # aggregate_count of the response tokens under loss_aggregation
  kl_count: jax.Array  # aggregate_count of the penalised tokens under kl_aggregation


def global_denominators(prompt_mask_NxS: jax.Array, response_mask_NxS: jax.Array, *, kl_on: KLOn = "prompt",
                        loss_aggregation: Aggregation = "seq-mean-token-mean",
                        kl_aggregation: str = "row-mean") -> Denominators:
  """Denominators of a batch: run on the whole update batch, pass to erpo_loss for each minibatch."""
  return Denominators(aggregate_count(scored_mask(response_mask_NxS), loss_aggregation),
                      aggregate_count(kl_mask(prompt_mask_NxS, response_mask_NxS, kl_on),
                                      kl_mode(kl_aggregation)))


def kl_mode(kl_aggregation: str) -> Aggregation:
  """The aggregate() mode of a KL aggregation name: row-mean -> seq-mean-token-mean, token-mean."""
  if kl_aggregation not in _KL_AGGREGATION:
    raise ValueError(f"kl_aggregation must be one of {sorted(_KL_AGGREGATION)}, got {kl_aggregation!r}")
  return _KL_AGGREGATION[kl_aggregation]


def ratio_NxS(logp_NxS: jax.Array, old_logp_NxS: jax.Array, mask_NxS: jax.Array) -> jax.Array:
  """r_t = exp(clip(logp_t - sg(old_t), -20, 20)), with the log-ratio masked before exp."""
  log_ratio = jnp.where(mask_NxS, logp_NxS - jax.lax.stop_gradient(old_logp_NxS), 0.0)
  return jnp.exp(jnp.clip(log_ratio, -RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))


def advantages_NxS(advantages: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Constant advantages [N] or [N, S] broadcast to [N, S]."""
  advantages = jax.lax.stop_gradient(jnp.asarray(advantages))
  return jnp.broadcast_to(advantages[:, None] if advantages.ndim == 1 else advantages, shape)


def clipped_pg_loss(logp_NxS: jax.Array, old_logp_NxS: jax.Array, advantages: jax.Array, mask_NxS: jax.Array,
                    eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None) -> jax.Array:
  """Per-token PPO surrogate [N, S] (SPEC 4), 0 off the mask.

  L_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),
  and with dual clip c > 1, for A < 0: L_t = min(L_t, -A c).
  advantages is [N] (broadcast over tokens) or [N, S]; it and old_logp are constants.
  """
  mask_NxS = scored_mask(mask_NxS)
  r_NxS = ratio_NxS(logp_NxS, old_logp_NxS, mask_NxS)
  a_NxS = jnp.where(mask_NxS, advantages_NxS(advantages, r_NxS.shape), 0.0)
  loss_NxS = jnp.maximum(-a_NxS * r_NxS, -a_NxS * jnp.clip(r_NxS, 1.0 - eps_low, 1.0 + eps_high))
  if dual_clip is not None:
    loss_NxS = jnp.where(a_NxS < 0, jnp.minimum(loss_NxS, -a_NxS * dual_clip), loss_NxS)
  return jnp.where(mask_NxS, loss_NxS, 0.0)


def erpo_loss(logp_NxS: jax.Array, old_logp_NxS: jax.Array | None, ref_logp_NxS: jax.Array,
              prompt_mask_NxS: jax.Array, response_mask_NxS: jax.Array, advantages_N: jax.Array,
              weights_N: jax.Array | None = None, *, alpha: float = 0.01, kl_on: KLOn = "prompt",
              estimator: str = "k3", log_ratio_clamp: float = 20.0, kl_max: float = 10.0,
              kl_tolerance: float = 0.0, kl_aggregation: str = "row-mean", eps_low: float = 0.2, eps_high: float = 0.2,
              dual_clip: float | None = None, loss_aggregation: Aggregation = "seq-mean-token-mean",
              entropy_NxS: jax.Array | None = None, entropy_coef: float = 0.0,
              denominators: Denominators | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """L = (1/B) sum_i w_i L_pg(i) + alpha (1/B) sum_i D(i) - entropy_coef * H   (SPEC 5).

  L_pg(i) aggregates clipped_pg_loss over the response tokens of row i; the
  row weight multiplies each of its tokens, so every aggregation mode sees
  w_i L_t. D(i) is the masked estimator over the tokens kl_on selects,
  aggregated per kl_aggregation ("row-mean" = per-row token mean then row
  mean; "token-mean"). H is the response entropy under loss_aggregation.
  weights_N=None means w = 1; old_logp_NxS=None means on-policy (old = sg(logp)).
  `denominators` (global_denominators of the whole update batch) replace the
  batch's own counts, so minibatch losses add up to the update batch's loss.
  Gradient flows through logp only: old, ref, advantages and weights are constants.
  kl_tolerance: per-token log-ratios within it of 0 are not penalised (kl.shrink; the cached reference's
  rounding, erpo.cache_tolerance); 0 is the exact penalty.
  Returns (loss, pieces): loss/pg, loss/kl, loss/total, kl/clamped_frac and entropy/mean as
  combinable pieces (algo.diagnostics.combine_metrics / finalize_metrics).
  """
  response_NxS = scored_mask(response_mask_NxS)
  penalised_NxS = kl_mask(prompt_mask_NxS, response_mask_NxS, kl_on)
  old_logp_NxS = logp_NxS if old_logp_NxS is None else old_logp_NxS
  w_N = jnp.ones(response_NxS.shape[:1], logp_NxS.dtype) if weights_N is None else weights_N
  # Rows without response tokens (padding rows) get w = 1 so a junk weight cannot reach the gradient.
  w_N = jax.lax.stop_gradient(jnp.where(response_NxS.any(axis=1), w_N, 1.0))
  pg_NxS = clipped_pg_loss(logp_NxS, old_logp_NxS, advantages_N, response_NxS, eps_low, eps_high, dual_clip)
  pg_sum, pg_local = aggregate(w_N[:, None] * pg_NxS, response_NxS, loss_aggregation)
  kl_NxS, clamped_NxS = token_kl(logp_NxS, ref_logp_NxS, penalised_NxS, estimator=estimator,
                                 log_ratio_clamp=log_ratio_clamp, kl_max=kl_max, tolerance=kl_tolerance)
  kl_sum, kl_local = aggregate(kl_NxS, penalised_NxS, kl_mode(kl_aggregation))
  pg_den, kl_den = (pg_local, kl_local) if denominators is None else denominators
  loss = ratio(pg_sum, pg_den) + alpha * ratio(kl_sum, kl_den)
  metrics = {"loss/pg/sum": pg_sum, "loss/pg/count": pg_local, "loss/kl/sum": kl_sum, "loss/kl/count": kl_local,
             "kl/clamped_frac/sum": clamped_NxS.sum().astype(kl_sum.dtype),
             "kl/clamped_frac/count": penalised_NxS.sum().astype(kl_sum.dtype)}
  if entropy_NxS is not None:
    ent_sum, ent_local = aggregate(entropy_NxS, response_NxS, loss_aggregation)
    loss = loss - entropy_coef * ratio(ent_sum, pg_den)
    metrics.update({"entropy/mean/sum": ent_sum, "entropy/mean/count": ent_local})
  metrics["loss/total/part"] = loss
  return loss, metrics

"""Statistics of an update that are only logged, never optimised, and how pieces combine into metrics.

Pieces are keyed by the metric's final name plus a suffix saying how to
combine them across minibatches, epochs and hosts: `name/sum` + `name/count`
(a mean), `name/part` (added), and `name` ending in `/min` or `/max`.
Dimension letters: N rows, S sequence length.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

from erpo_jax.algo import losses
from erpo_jax.algo.kl import scored_mask, token_kl
from erpo_jax.algo.weights import prompt_nll

def pg_diagnostics(logp_NxS: jax.Array, old_logp_NxS: jax.Array, advantages: jax.Array, mask_NxS: jax.Array,
                   eps_low: float = 0.2, eps_high: float = 0.2,
                   dual_clip: float | None = None) -> dict[str, jax.Array]:
  """Token counts where each clip is active (its branch has zero gradient) and ratio statistics.

  clip/low: A < 0 and r < 1 - eps_low; clip/high: A > 0 and r > 1 + eps_high;
  clip/dual: A < 0 and r > c. Fractions and the ratio mean are (sum, count)
  pieces over masked tokens; ratio min/max are over masked tokens (+-inf if none).
  """
  mask_NxS = scored_mask(mask_NxS)
  r_NxS = jax.lax.stop_gradient(losses.ratio_NxS(logp_NxS, old_logp_NxS, mask_NxS))
  a_NxS = losses.advantages_NxS(advantages, r_NxS.shape)
  count = mask_NxS.sum().astype(r_NxS.dtype)
  dual = (a_NxS < 0) & (r_NxS > dual_clip) if dual_clip is not None else jnp.zeros_like(mask_NxS)
  flags = {"clip/low": (a_NxS < 0) & (r_NxS < 1.0 - eps_low),
           "clip/high": (a_NxS > 0) & (r_NxS > 1.0 + eps_high), "clip/dual": dual}
  out = {}
  for name, flag_NxS in flags.items():
    out[f"{name}/sum"] = (flag_NxS & mask_NxS).sum().astype(r_NxS.dtype)
    out[f"{name}/count"] = count
  out["ratio/mean/sum"] = jnp.where(mask_NxS, r_NxS, 0.0).sum()
  out["ratio/mean/count"] = count
  out["ratio/min"] = jnp.where(mask_NxS, r_NxS, jnp.inf).min()
  out["ratio/max"] = jnp.where(mask_NxS, r_NxS, -jnp.inf).max()
  return out


def erpo_diagnostics(logp_NxS: jax.Array, ref_logp_NxS: jax.Array, prompt_mask_NxS: jax.Array,
                     response_mask_NxS: jax.Array, weights_N: jax.Array, *, log_ratio_clamp: float = 20.0,
                     kl_max: float = 10.0, kl_aggregation: str = "row-mean") -> dict[str, jax.Array]:
  """Logged whichever side is penalised: kl/query (prompt k3) and kl/policy (response k3) under
  kl_aggregation, and weight / current prompt NLL mean, min, max over rows that have those tokens."""
  logp_NxS, ref_logp_NxS = jax.lax.stop_gradient(logp_NxS), jax.lax.stop_gradient(ref_logp_NxS)
  out = {}
  for name, mask_NxS in (("kl/query", prompt_mask_NxS), ("kl/policy", response_mask_NxS)):
    k_NxS, _ = token_kl(logp_NxS, ref_logp_NxS, mask_NxS, estimator="k3",
                        log_ratio_clamp=log_ratio_clamp, kl_max=kl_max)
    out[f"{name}/sum"], out[f"{name}/count"] = losses.aggregate(k_NxS, scored_mask(mask_NxS),
                                                                losses.kl_mode(kl_aggregation))
  rows_N = scored_mask(response_mask_NxS).any(axis=1)
  nll_N, valid_N = prompt_nll(logp_NxS, prompt_mask_NxS)
  for name, v_N, keep_N in (("weight", jax.lax.stop_gradient(weights_N), rows_N), ("prompt_nll", nll_N, valid_N)):
    out[f"{name}/mean/sum"] = jnp.where(keep_N, v_N, 0.0).sum()
    out[f"{name}/mean/count"] = keep_N.sum().astype(out[f"{name}/mean/sum"].dtype)
    out[f"{name}/min"] = jnp.where(keep_N, v_N, jnp.inf).min()
    out[f"{name}/max"] = jnp.where(keep_N, v_N, -jnp.inf).max()
  return out


def combine_metrics(pieces: Sequence[Mapping[str, jax.Array]] | Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Merges metric pieces of several calls (a list of dicts, or one dict stacked on axis 0 as
  lax.scan returns it): sums add, counts add, min of mins, max of maxes, loss parts add."""
  if not isinstance(pieces, Mapping):
    pieces = jax.tree.map(lambda *xs: jnp.stack(xs), *pieces)
  reduce = {"min": jnp.min, "max": jnp.max}
  return {key: reduce.get(key.rsplit("/", 1)[-1], jnp.sum)(value, axis=0) for key, value in pieces.items()}


def finalize_metrics(pieces: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Metric values from pieces: name = ratio(name/sum, name/count), name = name/part, and
  min/max pieces under their own key with +-inf (no tokens) -> 0."""
  out = {}
  for key, value in pieces.items():
    name, kind = key.rsplit("/", 1)
    if kind == "sum":
      out[name] = losses.ratio(value, pieces[f"{name}/count"])
    elif kind in ("min", "max"):
      out[key] = jnp.where(jnp.isfinite(value), value, 0.0)
    elif kind == "part":
      out[name] = value
  return out

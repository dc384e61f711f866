"""The one jitted ERPO/GRPO update: forwards, penalties, advantages x weights, clipped ratio, optax update.

Dimension letters: B prompts, G samples per prompt, N = B*G rows (group-contiguous:
row n belongs to prompt n // G), S sequence length, M minibatches, K microbatches.

Each minibatch is one optimizer step whose loss is normalised over its own
tokens / rows; its K microbatches accumulate gradients with the minibatch's
denominators, so K changes memory, not the update. Advantages and question
weights are constants of the whole update batch.

`build_train_step` returns the ONE jitted function of the project's update, with
explicit shardings and donation of params and optimizer state. Everything the
update needs happens inside that XLA program: the policy forward (with grad),
the frozen reference forward or the cached reference prompt log-probs, the
k3 penalty on the chosen tokens, group-relative advantages (ppo.advantage)
multiplied by the question weights, the clipped ratio term, gradients, clipping
and the update. With ppo.mask_truncated the loss covers the response tokens of
rows that ended with EOS only (DAPO's overlong filtering); the advantages and
the logged KL / weight statistics still see every row.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from erpo_jax.algo import advantages, diagnostics, losses, weights
from erpo_jax.config import Config, PpoSection
from erpo_jax.model import logprobs
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.train import optim, packing


@flax.struct.dataclass
class UpdateBatch:
  """One update batch on device. Rows are group-contiguous (row n is prompt n // G)."""

  tokens: jax.Array  # [N, S] int32, prompt first, response next, right-padded
  prompt_mask: jax.Array  # [N, S] bool, prompt tokens
  query_mask: jax.Array  # [N, S] bool, the tokens the Query-KL and question NLL cover (erpo.query_span)
  response_mask: jax.Array  # [N, S] bool, sampled tokens incl. EOS, no padding
  rewards: jax.Array  # [N] float32
  ref_logp: jax.Array  # [N, S] float32 cached reference log-probs at prompt positions (reference=cached)
  static_weight: jax.Array  # [N] float32 w(q) from the static-weight cache (weights=static)
  truncated: jax.Array  # [N] bool, no EOS within rollout.max_new_tokens
  policy_kl: jax.Array  # [] bool, log kl/policy: with erpo.reference=cached, run the reference forward this step


def takes_reference(cfg: Config) -> bool:
  """The step gets the frozen reference's params: for its reference forward (erpo.reference=forward), or, with
  the cached reference, for the Policy-KL metric's forward on the steps that log it (log.policy_kl_every)."""
  return cfg.erpo.reference == "forward" or cfg.log.policy_kl_every > 0


def needs_old_pass(ppo: PpoSection, weights: str = "none") -> bool:
  """A forward of the whole batch before the first update: several optimizer steps need the behaviour
  log-probs, and dynamic weights over microbatches need the whole batch's prompt NLLs."""
  return ppo.minibatches * ppo.epochs > 1 or (weights == "dynamic" and ppo.microbatches > 1)


def _split_rows(x, m: int):
  """[N, ...] -> [M, N/M, ...] keeping groups whole when N/M is a multiple of G."""
  return x.reshape(m, x.shape[0] // m, *x.shape[1:])


def build_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule, cfg: Config, *,
                     mesh: Mesh, param_shardings, opt_shardings, ref_shardings=None):
  """Returns step(params, opt_state, ref_params, batch, prompt_bucket=None, response_capacity=None)
  -> (params, opt_state, metrics).

  cfg is frozen: the update reads its erpo, ppo, rollout and model sections and
  data.max_prompt_tokens as compile-time constants. prompt_bucket: static bound
  on the batch's prompt lengths (the sampler's prompt bucket); the shared-prefix
  forward runs prompt rows of that length. response_capacity: static bound on
  the response tokens of each packed stream (`logprobs.packed_streams`: one per
  batch shard; `packing.response_capacity` computes it; a SplitCapacity runs uniform groups
  forward-only); when given (and below (N / streams) * R) the forward packs them end to end. Both
  positional: jit takes no keywords here.

  ref_shardings: the reference's shardings when the step takes reference params. With
  erpo.reference=forward the loss uses the reference forward; with erpo.reference=cached the
  loss keeps the cached prompt log-probs and the forward serves only the Policy-KL metric,
  run by the same program on the steps whose batch.policy_kl is True (kl/policy is NaN on the
  others; without ref_shardings the cached step has no reference forward and no kl/policy).
  """
  e, p, G = cfg.erpo, cfg.ppo, cfg.rollout.group_size
  temperature = logprobs.scoring_temperature(cfg.rollout.temperature)
  old_pass = needs_old_pass(p, e.weights)

  # Packed responses: one stream per batch shard (each packs its own rows), response_capacity slots each.
  streams = lambda N: logprobs.packed_streams(N // G, mesh_lib.num_batch_shards(mesh))

  # Without a prompt penalty (GRPO) the loss reads no prompt position: their lm-head backward is skipped.
  prompt_grads = losses.penalises_prompt(e.kl_on)

  def logp_of(params, tokens, prompt_mask, response_mask, with_entropy, prompt_bucket, capacity,
              prompt_positions=True, response_len_N=None):
    N, S = tokens.shape
    layout = logprobs.choose_layout(
        N, S, group_size=G, prompt_bucket=prompt_bucket or cfg.data.max_prompt_tokens or S,
        response_bucket=cfg.rollout.max_new_tokens, capacity=capacity, streams=streams(N),
        shared=cfg.model.shared_prefix)
    lens = response_mask.sum(axis=1) if response_len_N is None else response_len_N
    return logprobs.log_probs(nnx.merge(graphdef, params), tokens, prompt_len_N=prompt_mask.sum(axis=1),
                              response_len_N=lens, temperature=temperature, chunk=cfg.model.logits_chunk,
                              layout=layout, with_entropy=with_entropy, prompt_grads=prompt_grads,
                              prompt_positions=prompt_positions)

  def step(params, opt_state, ref_params, batch: UpdateBatch, prompt_bucket: int | None = None,
           response_capacity: int | None = None):
    N = batch.tokens.shape[0]
    M, K = p.minibatches, p.microbatches
    # Packing is over the whole batch: minibatches and microbatches run unpacked.
    capacity = response_capacity if M * K == 1 else None
    split = capacity if isinstance(capacity, packing.SplitCapacity) else None
    if split and not packing.forward_only_applies(cfg):
      raise ValueError("SplitCapacity needs packing.forward_only_applies(cfg)")
    capacity = split.whole if split else capacity
    whole_batch_logp = lambda params, prompt_positions=True: jax.lax.stop_gradient(logp_of(
        params, batch.tokens, batch.prompt_mask, batch.response_mask, False, prompt_bucket, capacity, prompt_positions))
    # Advantages and weights are constants of the whole update batch, computed from every row.
    adv_N = advantages.group_advantages(batch.rewards, G, estimator=p.advantage, eps=p.advantage_eps,
                                        scale=p.advantage_scale)
    ref_logp = whole_batch_logp(ref_params) if e.reference == "forward" else batch.ref_logp
    # Cached reference with reference params: their forward gives the responses' reference log-probs, for
    # kl/policy only; the prompts keep the cached ones, so kl/query and the loss are those of the cached step.
    # The forward runs on the steps whose batch.policy_kl is set: one program for every step. It skips the
    # prompt positions' lm-head (the cached values replace them). On a CPU mesh of several devices it runs in
    # every step, its values kept on those steps (`conditional_collectives_unsafe`).
    policy_kl_only = e.reference == "cached" and ref_params is not None
    if policy_kl_only:
      with_ref = lambda: jnp.where(batch.prompt_mask, batch.ref_logp, whole_batch_logp(ref_params, False))
      if mesh_lib.conditional_collectives_unsafe(mesh):
        metric_ref_logp = jnp.where(batch.policy_kl, with_ref(), batch.ref_logp)
      else:
        metric_ref_logp = jax.lax.cond(batch.policy_kl, with_ref, lambda: batch.ref_logp)
    if old_pass:
      old_logp = whole_batch_logp(params)
    else:
      old_logp = jnp.zeros(batch.tokens.shape, jnp.float32)  # unused: sg(logp) of the one forward
    if e.weights == "static":
      w_N = batch.static_weight
    elif e.weights == "dynamic" and old_pass:
      w_N = weights.dynamic_weights(*weights.prompt_nll(old_logp, batch.query_mask), clip=e.dynamic_clip)
    else:
      w_N = jnp.ones((N,), jnp.float32)  # none, or dynamic from the one forward (below)

    def loss_mask(mb):
      """The response tokens the loss covers: all, or with ppo.mask_truncated those of untruncated rows."""
      if not p.mask_truncated:
        return mb["response_mask"]
      return mb["response_mask"] & ~mb["truncated"][:, None]

    def loss_fn(params, mb, denominators):
      cap, lens = (split.trained, jnp.where(mb["fwd_only"], 0, mb["response_len"])) if split else (capacity, None)
      logp, entropy = logp_of(params, mb["tokens"], mb["prompt_mask"], mb["response_mask"], True, prompt_bucket,
                              cap, response_len_N=lens)
      if split:  # uniform groups' responses: forward-only values, no gradient
        at = mb["fwd_only"][:, None] & mb["response_mask"]
        logp, entropy = jnp.where(at, mb["fwd_logp"], logp), jnp.where(at, mb["fwd_entropy"], entropy)
      old = mb["old_logp"] if old_pass else jax.lax.stop_gradient(logp)
      w = mb["w"]
      if e.weights == "dynamic" and not old_pass:
        # One minibatch = the whole update batch: its mean is the global mean.
        w = weights.dynamic_weights(*weights.prompt_nll(jax.lax.stop_gradient(logp), mb["query_mask"]),
                                    clip=e.dynamic_clip)
      loss, pieces = losses.erpo_loss(
          logp, old, mb["ref_logp"], mb["query_mask"], loss_mask(mb), mb["adv"], w,
          alpha=e.alpha, kl_on=e.kl_on, estimator=e.estimator, log_ratio_clamp=e.log_ratio_clamp,
          kl_max=e.kl_max, kl_tolerance=e.cache_tolerance if e.reference == "cached" else 0.0,
          eps_low=p.eps_low, eps_high=p.eps_high, dual_clip=p.dual_clip,
          loss_aggregation=p.loss_aggregation, kl_aggregation=e.kl_aggregation, entropy_NxS=entropy,
          entropy_coef=p.entropy_coef, denominators=denominators)
      pieces.update(diagnostics.pg_diagnostics(logp, old, mb["adv"], loss_mask(mb), p.eps_low, p.eps_high,
                                               p.dual_clip))
      pieces.update(diagnostics.erpo_diagnostics(
          logp, mb.get("metric_ref_logp", mb["ref_logp"]), mb["query_mask"], mb["response_mask"], w,
          log_ratio_clamp=e.log_ratio_clamp, kl_max=e.kl_max, kl_aggregation=e.kl_aggregation))
      return loss, pieces

    rows = {"tokens": batch.tokens, "prompt_mask": batch.prompt_mask, "query_mask": batch.query_mask,
            "response_mask": batch.response_mask, "truncated": batch.truncated,
            "ref_logp": ref_logp, "old_logp": old_logp, "adv": adv_N, "w": w_N}
    if policy_kl_only:
      rows["metric_ref_logp"] = metric_ref_logp
    if split:
      # Uniform groups (A = 0) add no gradient: their responses run forward-only, for the metrics.
      rows.update(packing.forward_only_values(logp_of, params, batch, G, streams(N), split, prompt_bucket,
                                              cfg.rollout.max_new_tokens))
    mbs = jax.tree.map(lambda x: _split_rows(x, M), rows)

    def minibatch_grads(params, mb):
      """Loss, pieces and gradient of one minibatch, its K microbatches summed with its own denominators."""
      denominators = losses.global_denominators(mb["query_mask"], loss_mask(mb),
                                                loss_aggregation=p.loss_aggregation,
                                                kl_aggregation=e.kl_aggregation, kl_on=e.kl_on)
      grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
      if K == 1:
        return grad_fn(params, mb, denominators)

      def accumulate(grad_sum, micro):
        (loss, pieces), grads = grad_fn(params, micro, denominators)
        return jax.tree.map(jnp.add, grad_sum, grads), (loss, pieces)

      zeros = jax.tree.map(jnp.zeros_like, params)
      grads, (loss_K, pieces_K) = jax.lax.scan(accumulate, zeros, jax.tree.map(lambda x: _split_rows(x, K), mb))
      return (loss_K.sum(), diagnostics.combine_metrics(pieces_K)), grads

    def one_update(carry, mb):
      params, opt_state = carry
      (loss, pieces), grads = minibatch_grads(params, mb)
      grad_norm = optax.tree.norm(grads)  # of the gradient that is clipped and applied
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, new_opt = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      # A non-finite update is never applied: state stays finite, the loop decides to stop or skip.
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      return (keep(new_params, params), keep(new_opt, opt_state)), (pieces, grad_norm, finite)

    count0 = optim.opt_count(opt_state)
    (params, opt_state), (pieces, grad_norm, finite) = jax.lax.scan(
        one_update, (params, opt_state),
        jax.tree.map(lambda x: jnp.tile(x, (p.epochs,) + (1,) * (x.ndim - 1)), mbs))
    metrics = diagnostics.finalize_metrics(diagnostics.combine_metrics(pieces))
    metrics["loss/total"] = metrics["loss/total"] / (M * p.epochs)  # the mean of the optimizer steps' losses
    metrics["optim/grad_norm"] = jnp.mean(grad_norm)
    metrics["optim/finite"] = jnp.min(finite.astype(jnp.float32))
    metrics["optim/lr"] = schedule(count0)
    metrics["reward/zero_std_groups"] = advantages.zero_std_group_fraction(batch.rewards, G)
    metrics["loss/masked_truncated"] = (jnp.mean(batch.truncated.astype(jnp.float32)) if p.mask_truncated
                                        else jnp.zeros((), jnp.float32))  # fraction of rows left out of the loss
    if e.reference == "cached" and not policy_kl_only:
      del metrics["kl/policy"]  # cached reference log-probs cover prompt tokens only
    elif policy_kl_only:  # NaN on the steps that skip the reference forward
      metrics["kl/policy"] = jnp.where(batch.policy_kl, metrics["kl/policy"], jnp.nan)
    return params, opt_state, metrics

  rows2, rows1 = mesh_lib.batch_sharding(mesh, 2), mesh_lib.batch_sharding(mesh, 1)
  batch_sh = UpdateBatch(tokens=rows2, prompt_mask=rows2, query_mask=rows2, response_mask=rows2, rewards=rows1,
                         ref_logp=rows2, static_weight=rows1, truncated=rows1,
                         policy_kl=mesh_lib.batch_sharding(mesh, 0))
  # Params and optimizer state are donated: the update happens in place in device memory.
  # prompt_bucket and response_capacity are static: one compile per value met.
  return jax.jit(step, in_shardings=(param_shardings, opt_shardings, ref_shardings, batch_sh),
                 out_shardings=(param_shardings, opt_shardings, mesh_lib.replicated(mesh)),
                 donate_argnums=(0, 1), static_argnums=(4, 5))


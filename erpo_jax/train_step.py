"""The one jitted ERPO/GRPO update: forwards, penalties, advantages x weights, clipped ratio, optax update.

Dimension letters: B prompts, G samples per prompt, N = B*G rows (group-contiguous:
row n belongs to prompt n // G), S sequence length, M minibatches.

`build_train_step` returns the ONE jitted function of the project's update, with
explicit shardings and donation of params and optimizer state. Everything the
update needs happens inside that XLA program: the policy forward (with grad),
the frozen reference forward or the cached reference prompt log-probs, the
k3 penalty on the chosen tokens, group-relative advantages multiplied by the
question weights, the clipped ratio term, gradients, clipping and the update.
"""

from __future__ import annotations

import dataclasses
import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from erpo_jax import losses, parallel
from erpo_jax.model import llama, shared_prefix


@flax.struct.dataclass
class UpdateBatch:
  """One update batch on device. Rows are group-contiguous (row n is prompt n // G)."""

  tokens: jax.Array  # [N, S] int32, prompt first, response next, right-padded
  prompt_mask: jax.Array  # [N, S] bool, prompt tokens
  response_mask: jax.Array  # [N, S] bool, sampled tokens incl. EOS, no padding
  rewards: jax.Array  # [N] float32
  ref_logp: jax.Array  # [N, S] float32 cached reference log-probs at prompt positions (reference=cached)
  static_weight: jax.Array  # [N] float32 w(q) from the static-weight cache (weights=static)


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """Static (compile-time) choices of the update; a change recompiles, so they are not traced."""

  group_size: int  # G
  weights: str  # none | static | dynamic
  kl_on: str  # prompt | response | all | none
  alpha: float
  estimator: str
  kl_aggregation: str
  log_ratio_clamp: float
  kl_max: float
  dynamic_clip: tuple[float, float] | None
  reference: str  # forward (reference forward in the step) | cached (prompt log-probs from the batch)
  eps_low: float
  eps_high: float
  dual_clip: float | None
  loss_aggregation: str
  advantage_scale: str
  advantage_eps: float
  entropy_coef: float
  minibatches: int
  epochs: int
  temperature: float  # log-probs are of softmax(logits / T), as sampled
  logits_chunk: int
  shared_prefix: bool  # training forwards run each group's prompt once (model.shared_prefix)
  max_prompt_len: int  # P cap: the sampler cuts prompts to data.max_prompt_tokens
  max_response_len: int  # R cap: responses have at most rollout.max_new_tokens tokens

  @property
  def needs_old_pass(self) -> bool:
    """Several optimizer steps per batch need the behaviour log-probs from before the first one."""
    return self.minibatches * self.epochs > 1


def settings_from_config(cfg) -> StepSettings:
  e, p = cfg.erpo, cfg.ppo
  reference = e.reference
  return StepSettings(
      group_size=cfg.rollout.group_size, weights=e.weights, kl_on=e.kl_on, alpha=e.alpha,
      estimator=e.estimator, kl_aggregation=e.kl_aggregation, log_ratio_clamp=e.log_ratio_clamp,
      kl_max=e.kl_max, dynamic_clip=e.dynamic_clip, reference=reference, eps_low=p.eps_low,
      eps_high=p.eps_high, dual_clip=p.dual_clip, loss_aggregation=p.loss_aggregation,
      advantage_scale=p.advantage_scale, advantage_eps=p.advantage_eps, entropy_coef=p.entropy_coef,
      minibatches=p.minibatches, epochs=p.epochs,
      temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
      logits_chunk=cfg.model.logits_chunk, shared_prefix=cfg.model.shared_prefix,
      max_prompt_len=cfg.data.max_prompt_tokens, max_response_len=cfg.rollout.max_new_tokens)


def make_optimizer(optim, total_steps: int, updates_per_step: int = 1) -> optax.GradientTransformation:
  """AdamW with linear warmup then constant / cosine / linear decay, global-norm clipping first."""
  total = max(total_steps * updates_per_step, 1)
  warm = optim.warmup_steps * updates_per_step
  if optim.schedule == "constant":
    after = optax.constant_schedule(optim.lr)
  elif optim.schedule == "cosine":
    after = optax.cosine_decay_schedule(optim.lr, max(total - warm, 1))
  else:
    after = optax.linear_schedule(optim.lr, 0.0, max(total - warm, 1))
  schedule = optax.join_schedules([optax.linear_schedule(0.0, optim.lr, warm), after], [warm]) if warm else after
  chain = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
  chain.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay))
  return optax.chain(*chain), schedule


def _split_rows(x, m: int):
  """[N, ...] -> [M, N/M, ...] keeping groups whole when N/M is a multiple of G."""
  return x.reshape(m, x.shape[0] // m, *x.shape[1:])


def build_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, schedule, s: StepSettings, *,
                     mesh: Mesh, param_shardings, opt_shardings, ref_shardings=None):
  """Returns step(params, opt_state, ref_params, batch, prompt_bucket=None, response_capacity=None)
  -> (params, opt_state, metrics).

  prompt_bucket: static bound on the batch's prompt lengths (the sampler's prompt
  bucket); the shared-prefix forward runs prompt rows of that length.
  response_capacity: static bound on the batch's response tokens; when given
  (and below N*R) the shared-prefix forward packs them end to end
  (`shared_prefix.packed_log_probs`). Both positional: jit takes no keywords here.
  """

  def logp_of(params, tokens, prompt_mask, response_mask, with_entropy, prompt_bucket, capacity):
    model = nnx.merge(graphdef, params)
    (N, S), G = tokens.shape, s.group_size
    P, R = min(prompt_bucket or s.max_prompt_len or S, S), min(s.max_response_len, S)  # 0: auto, not resolved
    if s.shared_prefix and capacity is not None and N % G == 0 and capacity < N * R:
      logp, entropy = shared_prefix.packed_log_probs(
          model, tokens, prompt_mask.sum(axis=1), response_mask.sum(axis=1), G, prompt_bucket=P,
          response_bucket=R, capacity=capacity, chunk=s.logits_chunk, temperature=s.temperature,
          with_entropy=with_entropy)
      return (logp, entropy) if with_entropy else logp
    # Static choice: run each group's prompt once when rows are whole groups and the
    # [B, P] + [N, R] layout holds fewer tokens than [N, S]; values and gradients are the same.
    if s.shared_prefix and N % G == 0 and (N // G) * P + N * R < N * S:
      logp, entropy = shared_prefix.shared_prefix_log_probs(
          model, tokens, prompt_mask.sum(axis=1), G, prompt_bucket=P, response_bucket=R, chunk=s.logits_chunk,
          temperature=s.temperature, with_entropy=with_entropy)
      return (logp, entropy) if with_entropy else logp
    return llama.log_probs(model, tokens, chunk=s.logits_chunk, temperature=s.temperature,
                           with_entropy=with_entropy)

  def step(params, opt_state, ref_params, batch: UpdateBatch, prompt_bucket: int | None = None,
           response_capacity: int | None = None):
    N = batch.tokens.shape[0]
    M = s.minibatches
    # Packing is over the whole batch: minibatches run unpacked.
    capacity = response_capacity if M == 1 else None
    whole_batch_logp = lambda p: jax.lax.stop_gradient(
        logp_of(p, batch.tokens, batch.prompt_mask, batch.response_mask, False, prompt_bucket, capacity))
    # Advantages and weights are constants of the whole update batch.
    adv_N = losses.group_advantages(batch.rewards, s.group_size, eps=s.advantage_eps, scale=s.advantage_scale)
    if s.reference == "forward":
      ref_logp = whole_batch_logp(ref_params)
    else:
      ref_logp = batch.ref_logp
    if s.needs_old_pass:
      old_logp = whole_batch_logp(params)
    else:
      old_logp = jnp.zeros(batch.tokens.shape, jnp.float32)  # unused: sg(logp) of the one forward
    denominators = losses.global_denominators(batch.prompt_mask, batch.response_mask,
                                              loss_aggregation=s.loss_aggregation,
                                              kl_aggregation=s.kl_aggregation, kl_on=s.kl_on)
    if s.weights == "static":
      w_N = batch.static_weight
    elif s.weights == "dynamic" and s.needs_old_pass:
      nll_N, valid_N = losses.prompt_nll(old_logp, batch.prompt_mask)
      w_N = losses.dynamic_weights(nll_N, valid_N, clip=s.dynamic_clip)
    else:
      w_N = jnp.ones((N,), jnp.float32)  # none, or dynamic from the one forward (below)

    def loss_fn(params, mb):
      logp, entropy = logp_of(params, mb["tokens"], mb["prompt_mask"], mb["response_mask"], True, prompt_bucket,
                             capacity)
      old = mb["old_logp"] if s.needs_old_pass else jax.lax.stop_gradient(logp)
      w = mb["w"]
      if s.weights == "dynamic" and not s.needs_old_pass:
        # One minibatch = the whole update batch: its mean is the global mean.
        nll_N, valid_N = losses.prompt_nll(jax.lax.stop_gradient(logp), mb["prompt_mask"])
        w = losses.dynamic_weights(nll_N, valid_N, clip=s.dynamic_clip)
      return losses.erpo_loss(
          logp, old, mb["ref_logp"], mb["prompt_mask"], mb["response_mask"], mb["adv"], w,
          alpha=s.alpha, kl_on=s.kl_on, estimator=s.estimator, log_ratio_clamp=s.log_ratio_clamp,
          kl_max=s.kl_max, eps_low=s.eps_low, eps_high=s.eps_high, dual_clip=s.dual_clip,
          loss_aggregation=s.loss_aggregation, kl_aggregation=s.kl_aggregation, entropy_NxS=entropy,
          entropy_coef=s.entropy_coef, denominators=denominators)

    rows = {"tokens": batch.tokens, "prompt_mask": batch.prompt_mask, "response_mask": batch.response_mask,
            "ref_logp": ref_logp, "old_logp": old_logp, "adv": adv_N, "w": w_N}
    mbs = jax.tree.map(lambda x: _split_rows(x, M), rows)

    def one_update(carry, mb):
      params, opt_state = carry
      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, new_opt = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      # A non-finite update is never applied: state stays finite, the loop decides to stop or skip.
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      metrics = dict(metrics, **{"optim/grad_norm": grad_norm, "optim/finite": finite.astype(jnp.float32)})
      return (keep(new_params, params), keep(new_opt, opt_state)), metrics

    count0 = _opt_count(opt_state)
    (params, opt_state), per_update = jax.lax.scan(
        one_update, (params, opt_state),
        jax.tree.map(lambda x: jnp.tile(x, (s.epochs,) + (1,) * (x.ndim - 1)), mbs))
    grad_norm = per_update.pop("optim/grad_norm")
    finite = per_update.pop("optim/finite")
    named = losses.finalize_metrics(losses.combine_metrics(per_update))
    named["loss"] = named["loss"] / s.epochs  # loss parts of every epoch were added up
    metrics = {METRIC_NAMES[k]: v for k, v in named.items()}
    metrics["optim/grad_norm"] = jnp.mean(grad_norm)
    metrics["optim/finite"] = jnp.min(finite)
    metrics["optim/lr"] = schedule(count0)
    metrics["reward/zero_std_groups"] = losses.zero_std_group_fraction(batch.rewards, s.group_size)
    if s.reference == "cached":
      # Cached reference log-probs cover prompt tokens only: Policy-KL comes from policy_kl_fn.
      del metrics["kl/policy"]
    return params, opt_state, metrics

  batch_sh = UpdateBatch(
      tokens=parallel.batch_sharding(mesh, 2), prompt_mask=parallel.batch_sharding(mesh, 2),
      response_mask=parallel.batch_sharding(mesh, 2), rewards=parallel.batch_sharding(mesh, 1),
      ref_logp=parallel.batch_sharding(mesh, 2), static_weight=parallel.batch_sharding(mesh, 1))
  # Params and optimizer state are donated: the update happens in place in device memory.
  # prompt_bucket and response_capacity are static: one compile per value met.
  return jax.jit(step, in_shardings=(param_shardings, opt_shardings, ref_shardings, batch_sh),
                 out_shardings=(param_shardings, opt_shardings, parallel.replicated(mesh)),
                 donate_argnums=(0, 1), static_argnums=(4, 5))


# losses.finalize_metrics names -> the names every run logs (erpo_jax.metrics.SPEC_SCALARS).
METRIC_NAMES = {
    "query_kl": "kl/query", "policy_kl": "kl/policy", "kl_loss": "loss/kl", "pg_loss": "loss/pg",
    "loss": "loss/total", "clip_low_frac": "clip/low", "clip_high_frac": "clip/high", "dual_clip_frac": "clip/dual",
    "kl_clamped_frac": "kl/clamped_frac", "ratio": "ratio/mean", "ratio_min": "ratio/min",
    "ratio_max": "ratio/max", "weight": "weight/mean", "weight_min": "weight/min", "weight_max": "weight/max",
    "prompt_nll": "prompt_nll/mean", "prompt_nll_min": "prompt_nll/min", "prompt_nll_max": "prompt_nll/max",
    "entropy": "entropy/mean",
}


def build_policy_kl(graphdef: nnx.GraphDef, s: StepSettings, *, mesh: Mesh, ref_shardings):
  """Jitted Policy-KL (response k3 mean) of sampled tokens against the frozen reference.

  For erpo.reference=cached, whose step has no reference forward. `logp_NxS`
  are the sampler's log-probs: those of the policy that generated the tokens.
  """

  def policy_kl(ref_params, tokens_NxS, response_mask_NxS, logp_NxS):
    ref = llama.log_probs(nnx.merge(graphdef, ref_params), tokens_NxS, chunk=s.logits_chunk,
                          temperature=s.temperature)
    kl = losses.query_kl(logp_NxS, ref, response_mask_NxS, estimator="k3", log_ratio_clamp=s.log_ratio_clamp,
                         kl_max=s.kl_max)
    # Mean over rows that have response tokens, as the step's kl/policy (row-mean aggregation).
    return losses.ratio(kl.per_row_N.sum(), (kl.count_N > 0).sum().astype(jnp.float32))

  rows = parallel.batch_sharding(mesh, 2)
  return jax.jit(policy_kl, in_shardings=(ref_shardings, rows, rows, rows), out_shardings=parallel.replicated(mesh))


def _opt_count(opt_state) -> jax.Array:
  """The optimizer's step counter (for the learning-rate metric)."""
  counts = [x.count for x in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "count"))
            if hasattr(x, "count")]
  return counts[0] if counts else jnp.zeros((), jnp.int32)


def opt_state_shardings(tx: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
  """Shardings for tx.init(params): moment trees follow the params, everything else is replicated."""
  abstract = jax.eval_shape(tx.init, params)
  params_def = jax.tree.structure(params)

  def is_param_tree(x):
    try:
      return jax.tree.structure(x) == params_def
    except Exception:  # noqa: BLE001 - leaves of foreign types are simply not param trees
      return False

  return jax.tree.map(lambda x: param_shardings if is_param_tree(x) else parallel.replicated(mesh),
                      abstract, is_leaf=is_param_tree)


def init_opt_state(tx: optax.GradientTransformation, params, opt_shardings):
  """tx.init placed directly on its shardings."""
  return jax.jit(tx.init, out_shardings=opt_shardings)(params)

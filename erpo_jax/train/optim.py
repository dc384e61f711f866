"""The optimizer of the update: AdamW after global-norm clipping, its schedule and its state's shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from erpo_jax.parallel import mesh as mesh_lib


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


def opt_count(opt_state) -> jax.Array:
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

  return jax.tree.map(lambda x: param_shardings if is_param_tree(x) else mesh_lib.replicated(mesh),
                      abstract, is_leaf=is_param_tree)


def init_opt_state(tx: optax.GradientTransformation, params, opt_shardings):
  """tx.init placed directly on its shardings."""
  return jax.jit(tx.init, out_shardings=opt_shardings)(params)

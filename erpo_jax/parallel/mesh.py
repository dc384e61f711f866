"""Device mesh, the logical-axis rule table, and shardings for params, optimizer state and batches."""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from erpo_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")
# Rows of a batch are split over these mesh axes.
BATCH_AXES = ("data", "fsdp")

# Logical parameter axis -> mesh axis. FSDP shards the model dimension of every
# matrix; tensor parallelism shards heads, MLP width and vocabulary.
AXIS_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "layers": None,
    "norm": None,
}


def make_mesh(mesh_section, devices=None) -> Mesh:
  """Mesh of shape (data, fsdp, tensor) from `cfg.mesh`; -1 takes the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [mesh_section.data, mesh_section.fsdp, mesh_section.tensor]
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(f"mesh: fixed axes {sizes} need a device count divisible by {known}, "
                        f"have {len(devices)} devices")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ConfigError(f"mesh: data*fsdp*tensor = {math.prod(sizes)} (sizes {tuple(sizes)}) must equal the "
                      f"device count {len(devices)}; set one axis to -1 to take the rest")
  arr = np.asarray(devices).reshape(sizes)
  return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def spec_for(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec for a parameter with logical `axes`; a dim that does not divide stays whole."""
  used: set[str] = set()
  out = []
  for name, dim in zip(axes, shape):
    mesh_axis = AXIS_RULES.get(name)
    if mesh_axis is None or mesh_axis in used or mesh.shape[mesh_axis] == 1 or dim % mesh.shape[mesh_axis]:
      out.append(None)
    else:
      out.append(mesh_axis)
      used.add(mesh_axis)
  return P(*out)


def param_shardings(state: nnx.State, mesh: Mesh):
  """NamedShardings with the structure of an nnx.State of Params (read from their `axes`)."""

  def one(var):
    axes = var.get_metadata().get("axes")
    value = var[...]
    if axes is None:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, spec_for(tuple(axes), value.shape, mesh))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def sharding_for_axes(mesh: Mesh):
  """A callable (axes, shape) -> NamedSharding, for loaders that place weights directly."""
  return lambda axes, shape: NamedSharding(mesh, spec_for(tuple(axes), tuple(shape), mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Rows over (data, fsdp), every other dim whole; a scalar (ndim 0, no rows) is replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))) if ndim else P())


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def conditional_collectives_unsafe(mesh: Mesh) -> bool:
  """True on a CPU mesh of more than one device: there XLA's CPU runtime can run a conditional holding
  collectives and a collective outside it in different orders on different devices, and every device then
  waits in a collective the others never reach (seen with jaxlib 0.10.2 on 8 CPU devices, once in about
  20 calls of the update whose Policy-KL reference forward sat in a `lax.cond`). Programs there compute
  both sides and select instead."""
  return mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def num_batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Places every parameter of `model` on its mesh sharding (in place) and returns it."""
  state = nnx.state(model)
  shardings = param_shardings(state, mesh)
  nnx.update(model, jax.device_put(state, shardings))
  return model

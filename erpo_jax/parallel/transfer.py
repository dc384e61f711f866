"""Host <-> global array transfers: each process's rows in, its addressable part out, rows gathered."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def host_local_to_global(array_np: Any, sharding: Any, global_shape: tuple[int, ...] | None = None) -> Any:
  """Builds a global `jax.Array` from the rows this process holds (a numpy array or a pytree of them).

  Returns an array with `sharding`; when `global_shape` is None each
  dimension sharded across processes grows by their number: with P
  processes and the leading axis sharded over all devices, local [n, ...]
  -> global [P*n, ...], process p's rows at the indices its devices own
  (p*n:(p+1)*n for a mesh in `jax.devices()` order). Dimensions replicated
  across processes keep their size and need the same values on every
  process. On one process this is `jax.device_put`.
  """
  return jax.make_array_from_process_local_data(sharding, array_np, global_shape)


def global_to_host_local(array: Any) -> Any:
  """Returns this process's part of a global `jax.Array` (or a pytree of them) as numpy.

  Reads only addressable shards, each distinct index region once (local
  replicas are skipped). The result is the compact block this process
  owns: along each dimension the distinct slices of its shards, in global
  order, side by side. It inverts `host_local_to_global` with an inferred
  global shape: batch-sharded [P*n, ...] -> [n, ...]; a replicated or
  single-process array -> the whole array.
  """
  return jax.tree.map(_one_to_host_local, array)


def allgather_rows(x_local: Any) -> np.ndarray:
  """Host arrays [n, ...] of all processes -> [P*n, ...] in process order, on every process (a collective)."""
  x = np.asarray(x_local)
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def all_processes(flag: bool) -> bool:
  """True when `flag` holds on every process (a collective on several processes)."""
  if jax.process_count() == 1:
    return flag
  return bool(allgather_rows(np.array([flag])).all())


def _one_to_host_local(array: Any) -> np.ndarray:
  if array.is_fully_addressable:
    return np.asarray(array)
  shape = array.shape
  shards = array.addressable_shards
  spans = [[(slc.indices(n)[0], slc.indices(n)[1]) for slc, n in zip(s.index, shape)] for s in shards]
  offsets = []  # per dimension: global (start, stop) -> local start
  for d in range(len(shape)):
    local, table = 0, {}
    for start, stop in sorted({span[d] for span in spans}):
      table[(start, stop)] = local
      local += stop - start
    offsets.append((table, local))
  out = np.empty([size for _, size in offsets], dtype=array.dtype)
  seen = set()
  for shard, span in zip(shards, spans):
    key = tuple(span)
    if key in seen:
      continue
    seen.add(key)
    dst = tuple(slice(table[(a, b)], table[(a, b)] + b - a) for (table, _), (a, b) in zip(offsets, span))
    out[dst] = np.asarray(shard.data)
  return out


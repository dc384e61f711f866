"""What a checkpoint holds and how it is checked and found: array checksums and finiteness, parameter shapes,
the data-iterator item, the PRNG key as JSON, a step's meta item, and the params of one step for eval, sample
and export. train/checkpoint.py's Checkpointer writes and restores a run's checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from erpo_jax.errors import NonFiniteError, PathError, UserError


def checksums(tree) -> list[str]:
  """Per leaf (flattening order) a 64-bit checksum of its bytes, as hex.

  Computed on the devices, so a sharded (multi-host) array needs no gather. The
  two 32-bit lanes are sums of the array's words times odd position weights
  (modulo 2**32), so any change of a single word always changes the checksum.
  """
  return summaries(tree)[0]


def summaries(tree) -> tuple[list[str], bool]:
  """(checksums, all finite) of `tree` from one pass over its leaves and one transfer: `checksums`, and True
  when no floating-point leaf holds NaN or Inf."""
  leaves = jax.tree.leaves(pure(tree))
  if not leaves:
    return [], True
  sums, finite = jax.device_get(_summaries(leaves))
  return [f"{int(a):08x}{int(b):08x}" for a, b in np.asarray(sums)], bool(np.all(finite))


def finite_checksums(step: int, trees: dict) -> dict[str, list[str]]:
  """`summaries` of each named tree (one pass each): its checksums; raises NonFiniteError naming `step` when a
  tree holds NaN or Inf. The checkpoint save and the loop's skipped updates check the training state so."""
  found = {k: summaries(t) for k, t in trees.items()}
  if not all(finite for _, finite in found.values()):
    raise NonFiniteError(step, "parameters or optimizer state")
  return {k: sums for k, (sums, _) in found.items()}


@jax.jit
def _summaries(leaves: list) -> tuple[jax.Array, jax.Array]:
  # One program per tree structure, not one per leaf shape as eager ops would compile. Per leaf one reduction
  # with three lanes, which XLA fuses with the products feeding them: no temporary the size of the leaf (two
  # checksum sums apart made XLA write every leaf's words out whole, 2.1 GB for SmolLM2-135M's parameters and
  # AdamW state, and isfinite(x).all() its booleans, 0.27 GB; one pass takes 0.06 s where those took 1.6 s).
  sums, finite = [], []
  for x in leaves:
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    values = x.reshape(-1)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size])
    words = words.reshape(-1).astype(jnp.uint32)
    i = jax.lax.iota(jnp.uint32, words.shape[0])
    lane_a = words * (2 * i + 1)
    lane_b = (words ^ (i * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B) * (2 * i + 3)
    # x * 0 is 0 for a finite x and NaN for NaN and +-Inf: the lane's sum is finite exactly when the leaf is.
    if jnp.issubdtype(values.dtype, jnp.inexact):
      nan_lane = values * jnp.zeros((), values.dtype)
      per_value = words.shape[0] // values.shape[0]  # an 8-byte value is two words
      nan_lane = jnp.broadcast_to(nan_lane.astype(jnp.float32)[:, None], (values.shape[0], per_value)).reshape(-1)
    else:
      nan_lane = jnp.zeros(words.shape, jnp.float32)
    zero = jnp.uint32(0)
    a, b, z = jax.lax.reduce((lane_a, lane_b, nan_lane), (zero, zero, jnp.float32(0)),
                             lambda p, q: (p[0] + q[0], p[1] + q[1], p[2] + q[2]), (0,))
    sums.append(jnp.stack([a, b]))
    finite.append(jnp.isfinite(z))
  return jnp.stack(sums), jnp.stack(finite)


# ---------------- damaged arrays: one error, not one traceback per concurrent reader

# Orbax reads the arrays of a checkpoint in concurrent coroutines. When the bytes of several arrays are damaged,
# the first failure is raised to the caller (and reported there in one line); the other readers are abandoned
# mid-read and raise again when they are garbage-collected, which Python prints as "Exception ignored in
# <coroutine ...>" with a traceback, at a moment that depends on the garbage collector.
READER_ERROR = "Encountered error while reading array index"


def _drop_reader_errors(previous):
  def hook(unraisable):
    if READER_ERROR in str(unraisable.exc_value) and "coroutine" in repr(unraisable.object):
      return
    previous(unraisable)
  hook.drops_reader_errors = True
  return hook


@contextlib.contextmanager
def quiet_reader_errors():
  """Drops the abandoned readers' second reports of a read error that a restore within has raised.

  The filter stays installed for the rest of the process (the readers may be collected after the restore
  returns); every other unraisable exception still reaches the hook installed before it.
  """
  if not getattr(sys.unraisablehook, "drops_reader_errors", False):
    sys.unraisablehook = _drop_reader_errors(sys.unraisablehook)
  try:
    yield
  except BaseException:
    gc.collect()
    raise


# ---------------- data-iterator state


class DataStateHandler(ocp.CheckpointHandler):
  """Each process writes its own data-iterator state to process_<i>-of-<n>.json (as Grain's handler does)."""

  def save(self, directory, args):
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    (directory / name).write_text(json.dumps(args.state))

  def restore(self, directory, args=None):
    del args
    n = jax.process_count()
    path = directory / f"process_{jax.process_index()}-of-{n}.json"
    if not path.exists():
      saved = len(list(directory.glob("process_*.json")))
      raise UserError(f"checkpoint {directory.parent}: the data-iterator state was saved by {saved} process(es), "
                      f"this run has {n}; resume with the same number of processes")
    return json.loads(path.read_text())


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  pass


# ---------------- helpers


def check_params_fit(saved, target, where, fingerprint: str) -> None:
  """Raises UserError naming the first parameter whose name or shape differs from the checkpoint's."""
  have, want = shapes(saved.tree if hasattr(saved, "tree") else saved), shapes(pure(target))
  extra, missing = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
  bad = [k for k in want if k in have and want[k] != have[k]]
  problem = (f"this model has parameters {extra} the checkpoint lacks" if extra else
             f"the checkpoint has parameters {missing} this model lacks" if missing else
             f"parameter '{bad[0]}' is {have[bad[0]]} in the checkpoint but {want[bad[0]]} in this model" if bad
             else None)
  if problem:
    raise UserError(f"checkpoint {where} was written for model '{fingerprint}' and does not fit this model: "
                    f"{problem}")


def checksum_mismatch(restored, saved: list | None) -> str | None:
  """The name of the first restored leaf whose checksum differs from `saved`; None when all match.

  Leaves restored into another dtype than they were saved in (and checkpoints
  written before checksums were saved) are not compared.
  """
  if not saved:
    return None
  flat, _ = jax.tree_util.tree_flatten_with_path(restored)
  sums = checksums([x for _, x in flat])
  for (path, x), got, (dtype, want) in zip(flat, sums, saved):
    if dtype == str(x.dtype) and got != want:
      return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
  return None


def shapes(tree) -> dict[str, tuple[int, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
  name = lambda path: "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
  return {name(path): tuple(x.shape) for path, x in flat}


def pure(tree):
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def like(target, restored):
  """Restored pure values in the container kind of `target` (nnx.State targets are left untouched)."""
  if isinstance(target, nnx.State):
    out = jax.tree.map(lambda x: x, target)  # new Variables, so `target` keeps its values
    nnx.replace_by_pure_dict(out, restored)
    return out
  return restored


def abstract(target):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, pure(target))


def key_to_json(key: jax.Array) -> dict:
  """{'impl', 'data'}; impl None for a raw uint32 key (jax.random.PRNGKey)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}
  return {"impl": None, "data": np.asarray(key).tolist()}


def key_from_json(d: dict) -> jax.Array:
  data = jnp.asarray(np.asarray(d["data"], np.uint32))
  return data if d["impl"] is None else jax.random.wrap_key_data(data, impl=d["impl"])


def saved_meta(step_dir: pathlib.Path) -> dict:
  """The meta item of a step folder ({} when it cannot be read)."""
  try:
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
      meta = ckptr.restore(step_dir / "meta", args=ocp.args.JsonRestore())
    return meta if isinstance(meta, dict) else {}
  except Exception:  # pylint: disable=broad-except
    return {}


def saved_fingerprint(step_dir: pathlib.Path) -> str:
  return saved_meta(step_dir).get("fingerprint", "unknown")


def first_line(e: Exception) -> str:
  line = (str(e).strip().splitlines() or [type(e).__name__])[0]
  return line.split(" See full TensorStore details")[0][:300]


CHECKPOINTS_DIR = "checkpoints"  # <run.dir>/checkpoints/<step>


TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointDamagedError(PathError):
  """A checkpoint on disk is incomplete or its arrays differ from the checksums saved with them."""


# ---------------- params only


def find_checkpoint(checkpoint: str, run_dir) -> pathlib.Path:
  """The step folder named by `checkpoint`: 'latest', a step number, a step folder or a run folder."""
  ckpt_dir = pathlib.Path(run_dir) / CHECKPOINTS_DIR
  if checkpoint == "latest" or checkpoint.isdigit():
    steps = complete_steps(ckpt_dir)
    if not steps:
      raise PathError(f"checkpoint '{checkpoint}': no complete checkpoint in {ckpt_dir}; train first "
                      "or give a step folder such as runs/x/checkpoints/100")
    step = steps[-1] if checkpoint == "latest" else int(checkpoint)
    if step not in steps:
      raise PathError(f"checkpoint '{checkpoint}': no step {step} in {ckpt_dir}; complete steps: {steps}")
    return ckpt_dir / str(step)
  p = pathlib.Path(checkpoint)
  if (p / "params").is_dir() and (p / "_CHECKPOINT_METADATA").is_file() and TMP_SUFFIX not in p.name:
    return p
  for base in (p / CHECKPOINTS_DIR, p):
    steps = complete_steps(base)
    if steps:
      return base / str(steps[-1])
  raise PathError(f"checkpoint '{checkpoint}': not a step folder (<run.dir>/{CHECKPOINTS_DIR}/<step>) "
                  "or a run folder with complete checkpoints")


def restore_params(model: nnx.Module, checkpoint: str, run_dir):
  """Loads the params of a checkpoint into `model` in place (shapes, dtypes, shardings of the model); returns it."""
  # Orbax reads no item metadata from a relative path (it warns and returns None).
  step_dir = find_checkpoint(checkpoint, run_dir).absolute()
  state = nnx.state(model, nnx.Param)
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
    try:
      saved = ckptr.metadata(step_dir / "params").item_metadata
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointDamagedError(f"checkpoint {step_dir}: its params cannot be read ({first_line(e)})") from None
    check_params_fit(saved, state, step_dir, saved_fingerprint(step_dir))
    try:
      with quiet_reader_errors():
        restored = ckptr.restore(step_dir / "params", args=ocp.args.StandardRestore(abstract(state)))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointDamagedError(f"checkpoint {step_dir}: its arrays cannot be read ({first_line(e)})") from None
  bad = checksum_mismatch(restored, saved_meta(step_dir).get("checksums", {}).get("params"))
  if bad is not None:
    raise CheckpointDamagedError(f"checkpoint {step_dir}: params array '{bad}' differs from its saved checksum")
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(model, state)
  return model


def complete_steps(directory: pathlib.Path) -> list[int]:
  if not directory.is_dir():
    return []
  return sorted(ocp.path.step.checkpoint_steps(directory))

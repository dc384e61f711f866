"""Orbax checkpoints of a run: params, optimizer state, step, PRNG key, data-iterator state, config."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from erpo_jax.errors import NonFiniteError, PathError, UserError

CHECKPOINTS_DIR = "checkpoints"  # <run.dir>/checkpoints/<step>
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class CheckpointWriteError(PathError):
  """A checkpoint could not be written (disk full, folder removed); older checkpoints are intact."""


class CheckpointDamagedError(PathError):
  """A checkpoint on disk is incomplete or its arrays differ from the checksums saved with them."""


@dataclasses.dataclass(frozen=True)
class RestoredState:
  step: int  # the last completed update step
  params: Any  # same kind as params_target: a pure dict or an nnx.State
  opt_state: Any  # same kind as opt_state_target
  rng_key: jax.Array
  data_state: dict  # this process's data-iterator state
  config_text: str  # the resolved config the run was saved with


def model_fingerprint(model_cfg, tokenizer_fingerprint: str = "") -> str:
  """'<arch>-L<layers>-D<hidden>-V<vocab>-<hash>': readable, and equal iff model config and tokenizer are."""
  blob = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str) + "|" + tokenizer_fingerprint
  digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
  c = model_cfg
  return f"{c.architecture}-L{c.num_layers}-D{c.hidden_size}-V{c.vocab_size}-{digest}"


def all_finite(tree) -> bool:
  """True when no floating-point leaf of `tree` holds NaN or Inf (one device-to-host transfer)."""
  leaves = [x for x in jax.tree.leaves(_pure(tree)) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return bool(_all_finite(leaves)) if leaves else True


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
  # One program per tree structure, not one per leaf shape as eager ops would compile.
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def checksums(tree) -> list[str]:
  """Per leaf (flattening order) a 64-bit checksum of its bytes, as hex.

  Computed on the devices, so a sharded (multi-host) array needs no gather. The
  two 32-bit lanes are sums of the array's words times odd position weights
  (modulo 2**32), so any change of a single word always changes the checksum.
  """
  leaves = jax.tree.leaves(_pure(tree))
  if not leaves:
    return []
  sums = np.asarray(jax.device_get(_checksums(leaves)))
  return [f"{int(a):08x}{int(b):08x}" for a, b in sums]


@jax.jit
def _checksums(leaves: list) -> jax.Array:
  out = []
  for x in leaves:
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size])
    words = words.reshape(-1).astype(jnp.uint32)
    i = jnp.arange(words.shape[0], dtype=jnp.uint32)
    a = jnp.sum(words * (2 * i + 1), dtype=jnp.uint32)
    b = jnp.sum((words ^ (i * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B) * (2 * i + 3), dtype=jnp.uint32)
    out.append(jnp.stack([a, b]))
  return jnp.stack(out)


# ---------------- data-iterator state


class _DataStateHandler(ocp.CheckpointHandler):
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


@ocp.args.register_with_handler(_DataStateHandler, for_save=True)
@dataclasses.dataclass
class _DataStateSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(_DataStateHandler, for_restore=True)
@dataclasses.dataclass
class _DataStateRestore(ocp.args.CheckpointArgs):
  pass


# ---------------- checkpointer


class Checkpointer:
  """Saves and restores a run's training state in <run_dir>/checkpoints/<step>.

  Every process of a multi-host run makes the same calls. `save` returns once
  the arrays are copied off the accelerator (so the caller may donate them) and
  the files are written in the background. Orbax writes each step into
  `<step>.orbax-checkpoint-tmp` and renames it when complete, so a process
  killed mid-write leaves no folder that `latest_step` would pick; such
  temporary folders are removed when the next Checkpointer opens the run. A
  failed write (disk full, folder removed) raises CheckpointWriteError from the
  next `save` or `wait`; older checkpoints stay restorable, and checkpoints
  beyond `keep` are deleted only after a newer one is complete.
  """

  def __init__(self, run_dir, *, every: int, keep: int, async_save: bool = True, fingerprint: str):
    self.directory = pathlib.Path(run_dir).absolute() / CHECKPOINTS_DIR
    self.every = every  # steps between checkpoints; 0 = only forced saves
    self.fingerprint = fingerprint
    if self.directory.exists() and not self.directory.is_dir():
      raise PathError(f"{self.directory} is a file; checkpoints need a folder")
    _remove_torn_writes(self.directory)
    # Step folders are made before `save` returns: a checkpoints folder that vanished fails there at once
    # (made in the background, Orbax's synchronous items would wait 5 minutes for a folder never made).
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                           async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(), "data": _DataStateHandler()}
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._pending: int | None = None  # step of a save whose write may still be running

  def should_save(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0

  def save(self, step: int, *, params, opt_state, rng_key: jax.Array, data_state: dict, config_text: str,
           force: bool = False) -> bool:
    """Starts writing checkpoint `step` when `should_save(step)` or `force`; returns whether it did.

    Raises NonFiniteError if params or optimizer state hold NaN/Inf, and
    CheckpointWriteError if an earlier asynchronous write failed.
    """
    if not (force or self.should_save(step)):
      return False
    self.wait()
    if step in self.all_steps():
      return False
    if not (all_finite(params) and all_finite(opt_state)):
      raise NonFiniteError(step, "parameters or optimizer state")
    trees = {"params": _pure(params), "opt_state": _pure(opt_state)}
    meta = {"step": step, "fingerprint": self.fingerprint, "rng": _key_to_json(rng_key), "config": config_text,
            "leaves": {k: len(jax.tree.leaves(t)) for k, t in trees.items()},
            "checksums": {k: [[str(x.dtype), c] for x, c in zip(jax.tree.leaves(t), checksums(t))]
                          for k, t in trees.items()}}
    # Orbax refuses trees without leaves (optax.sgd's state); they hold nothing to save.
    items = {k: ocp.args.StandardSave(t) for k, t in trees.items() if jax.tree.leaves(t)}
    args = ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta), data=_DataStateSave(data_state))
    self._pending = step
    try:
      self._mgr.save(step, args=args, force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_error(e) from e
    return True

  def wait(self) -> None:
    """Blocks until pending writes finish; raises CheckpointWriteError if one failed."""
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._write_error(e) from e
    self._pending = None

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, ascending."""
    return _complete_steps(self.directory)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint on disk (a write still in progress does not count)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, step: int | None = None, *, params_target, opt_state_target) -> RestoredState:
    """Restores checkpoint `step` (default: latest) onto the shapes, dtypes and shardings of the targets.

    Targets are the live params / optimizer state, or ShapeDtypeStructs. Raises
    CheckpointDamagedError when the checkpoint cannot be read or its arrays differ
    from the checksums saved with them, UserError when it belongs to another model
    or optimizer.
    """
    self.wait()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise PathError(f"no checkpoint to resume from in {self.directory}")
      step = steps[-1]
    if step not in steps:
      raise PathError(f"checkpoint step {step} not found in {self.directory}; complete steps: {steps}")
    where = self.directory / str(step)
    try:
      meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
      saved_fingerprint, saved_leaves = meta["fingerprint"], meta["leaves"]
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointDamagedError(f"checkpoint {where}: its metadata cannot be read ({_first_line(e)})") from None
    if saved_fingerprint != self.fingerprint:
      raise UserError(f"checkpoint {where} was written for model '{saved_fingerprint}', but this run's model is "
                      f"'{self.fingerprint}'; use the same model and tokenizer, or a fresh run.dir")
    targets = {"params": params_target, "opt_state": opt_state_target}
    saved_items = {}
    for k in targets:
      try:
        saved_items[k] = getattr(self._mgr.item_metadata(step), k, None) if saved_leaves[k] else {}
      except Exception as e:  # pylint: disable=broad-except
        raise CheckpointDamagedError(f"checkpoint {where}: its {k} cannot be read ({_first_line(e)})") from None
      if saved_items[k] is None:
        raise CheckpointDamagedError(f"checkpoint {where}: its {k} folder is missing or incomplete")
    _check_params_fit(saved_items["params"], params_target, where, saved_fingerprint)
    for k, t in targets.items():
      if len(jax.tree.leaves(_pure(t))) != saved_leaves[k]:
        raise UserError(f"checkpoint {where} holds {saved_leaves[k]} {k} arrays, this run has "
                        f"{len(jax.tree.leaves(_pure(t)))}; resume with the settings it was saved with")
    saved_opt = sorted(_shapes(getattr(saved_items["opt_state"], "tree", saved_items["opt_state"])).values())
    if saved_leaves["opt_state"] and saved_opt != sorted(_shapes(_pure(opt_state_target)).values()):
      raise UserError(f"checkpoint {where} holds optimizer state of other shapes than this run's "
                      f"optimizer; resume with the settings it was saved with")
    items = {k: ocp.args.StandardRestore(_abstract(t)) for k, t in targets.items() if saved_leaves[k]}
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(**items, data=_DataStateRestore()))
    except UserError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointDamagedError(f"checkpoint {where}: its arrays cannot be read ({_first_line(e)})") from None
    for k in items:
      bad = _checksum_mismatch(out[k], meta.get("checksums", {}).get(k))
      if bad is not None:
        raise CheckpointDamagedError(f"checkpoint {where}: {k} array '{bad}' differs from its saved checksum")
    restored = {k: _like(t, out[k]) if k in items else t for k, t in targets.items()}
    return RestoredState(step=step, params=restored["params"], opt_state=restored["opt_state"],
                         rng_key=_key_from_json(meta["rng"]), data_state=out.data, config_text=meta["config"])

  def restore_latest_intact(self, *, params_target, opt_state_target, warn=None) -> RestoredState | None:
    """Restores the newest checkpoint that is complete and matches its checksums; None when there is none.

    Each damaged newer checkpoint is reported through `warn` (one line: which and
    why) and moved aside to `<step>.damaged` so that its step can be saved again.
    Raises CheckpointDamagedError when checkpoints exist but none is intact.
    """
    self.wait()
    damaged = []
    for step in reversed(self.all_steps()):
      try:
        restored = self.restore(step, params_target=params_target, opt_state_target=opt_state_target)
      except CheckpointDamagedError as e:
        damaged.append((step, str(e)))
        continue
      for _, message in damaged:
        if warn is not None:
          warn(f"{message}; resuming from the newest intact checkpoint, step {step}")
      self._set_aside(s for s in self.all_steps() if s > step)
      return restored
    if damaged:
      reasons = "; ".join(f"{CHECKPOINTS_DIR}/{s}: {m.split(': ', 1)[-1][:90]}" for s, m in damaged)
      raise CheckpointDamagedError(f"no intact checkpoint in {self.directory} ({reasons}); restore the folder "
                                   "from a backup or start a fresh run.dir")
    return None

  def _set_aside(self, steps) -> None:
    """Renames damaged step folders to `<step>.damaged[.n]`, which no step listing counts."""
    if jax.process_index() == 0:
      for step in list(steps):
        src = self.directory / str(step)
        dst, n = self.directory / f"{step}.damaged", 1
        while dst.exists():
          dst, n = self.directory / f"{step}.damaged.{n}", n + 1
        os.rename(src, dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("erpo-jax: damaged checkpoints set aside")
    self._mgr.reload()

  def close(self) -> None:
    """Waits for pending writes (see `wait`) and releases Orbax's threads."""
    try:
      self.wait()
    finally:
      self._mgr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _write_error(self, e: Exception) -> CheckpointWriteError:
    step, self._pending = self._pending, None
    try:
      # Orbax has dropped steps it meant to delete after the failed one; re-read the disk so that
      # `keep` applies to them again, and remove the torn folder now that no write is running.
      _remove_torn_writes(self.directory)
      self._mgr.reload()
      latest = self.latest_step()
    except Exception:  # pylint: disable=broad-except
      latest = None
    left = f"the latest complete checkpoint is step {latest}" if latest is not None else "none is readable there"
    return CheckpointWriteError(f"checkpoint step {step} could not be written to {self.directory} "
                                f"({_first_line(e)}); {left}")


# ---------------- params only


def find_checkpoint(checkpoint: str, run_dir) -> pathlib.Path:
  """The step folder named by `checkpoint`: 'latest', a step number, a step folder or a run folder."""
  ckpt_dir = pathlib.Path(run_dir) / CHECKPOINTS_DIR
  if checkpoint == "latest" or checkpoint.isdigit():
    steps = _complete_steps(ckpt_dir)
    if not steps:
      raise PathError(f"checkpoint '{checkpoint}': no complete checkpoint in {ckpt_dir}; train first "
                      "or give a step folder such as runs/x/checkpoints/100")
    step = steps[-1] if checkpoint == "latest" else int(checkpoint)
    if step not in steps:
      raise PathError(f"checkpoint '{checkpoint}': no step {step} in {ckpt_dir}; complete steps: {steps}")
    return ckpt_dir / str(step)
  p = pathlib.Path(checkpoint)
  if (p / "params").is_dir() and (p / "_CHECKPOINT_METADATA").is_file() and _TMP_SUFFIX not in p.name:
    return p
  for base in (p / CHECKPOINTS_DIR, p):
    steps = _complete_steps(base)
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
      raise CheckpointDamagedError(f"checkpoint {step_dir}: its params cannot be read ({_first_line(e)})") from None
    _check_params_fit(saved, state, step_dir, _saved_fingerprint(step_dir))
    try:
      restored = ckptr.restore(step_dir / "params", args=ocp.args.StandardRestore(_abstract(state)))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointDamagedError(f"checkpoint {step_dir}: its arrays cannot be read ({_first_line(e)})") from None
  bad = _checksum_mismatch(restored, _saved_meta(step_dir).get("checksums", {}).get("params"))
  if bad is not None:
    raise CheckpointDamagedError(f"checkpoint {step_dir}: params array '{bad}' differs from its saved checksum")
  nnx.replace_by_pure_dict(state, restored)
  nnx.update(model, state)
  return model


# ---------------- helpers


def _check_params_fit(saved, target, where, fingerprint: str) -> None:
  """Raises UserError naming the first parameter whose name or shape differs from the checkpoint's."""
  have, want = _shapes(saved.tree if hasattr(saved, "tree") else saved), _shapes(_pure(target))
  extra, missing = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
  bad = [k for k in want if k in have and want[k] != have[k]]
  problem = (f"this model has parameters {extra} the checkpoint lacks" if extra else
             f"the checkpoint has parameters {missing} this model lacks" if missing else
             f"parameter '{bad[0]}' is {have[bad[0]]} in the checkpoint but {want[bad[0]]} in this model" if bad
             else None)
  if problem:
    raise UserError(f"checkpoint {where} was written for model '{fingerprint}' and does not fit this model: "
                    f"{problem}")


def _checksum_mismatch(restored, saved: list | None) -> str | None:
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


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
  name = lambda path: "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
  return {name(path): tuple(x.shape) for path, x in flat}


def _remove_torn_writes(directory: pathlib.Path) -> None:
  """Deletes the temporary folders of writes that never completed (synchronously, unlike Orbax's cleanup)."""
  if jax.process_index() == 0 and directory.is_dir():
    for p in directory.glob(f"*{_TMP_SUFFIX}*"):
      shutil.rmtree(p, ignore_errors=True)


def _complete_steps(directory: pathlib.Path) -> list[int]:
  if not directory.is_dir():
    return []
  return sorted(ocp.path.step.checkpoint_steps(directory))


def _pure(tree):
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def _like(target, restored):
  """Restored pure values in the container kind of `target` (nnx.State targets are left untouched)."""
  if isinstance(target, nnx.State):
    out = jax.tree.map(lambda x: x, target)  # new Variables, so `target` keeps its values
    nnx.replace_by_pure_dict(out, restored)
    return out
  return restored


def _abstract(target):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, _pure(target))


def _key_to_json(key: jax.Array) -> dict:
  """{'impl', 'data'}; impl None for a raw uint32 key (jax.random.PRNGKey)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}
  return {"impl": None, "data": np.asarray(key).tolist()}


def _key_from_json(d: dict) -> jax.Array:
  data = jnp.asarray(np.asarray(d["data"], np.uint32))
  return data if d["impl"] is None else jax.random.wrap_key_data(data, impl=d["impl"])


def _saved_meta(step_dir: pathlib.Path) -> dict:
  """The meta item of a step folder ({} when it cannot be read)."""
  try:
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
      meta = ckptr.restore(step_dir / "meta", args=ocp.args.JsonRestore())
    return meta if isinstance(meta, dict) else {}
  except Exception:  # pylint: disable=broad-except
    return {}


def _saved_fingerprint(step_dir: pathlib.Path) -> str:
  return _saved_meta(step_dir).get("fingerprint", "unknown")


def _first_line(e: Exception) -> str:
  line = (str(e).strip().splitlines() or [type(e).__name__])[0]
  return line.split(" See full TensorStore details")[0][:300]

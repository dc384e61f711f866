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
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from erpo_jax import allocator
from erpo_jax.errors import PathError, UserError
from erpo_jax.train import checkpoint_io as cio


class CheckpointWriteError(PathError):
  """A checkpoint could not be written (disk full, folder removed); older checkpoints are intact."""


@dataclasses.dataclass(frozen=True)
class RestoredState:
  step: int  # the last completed update step
  params: Any  # same kind as params_target: a pure dict or an nnx.State
  opt_state: Any  # same kind as opt_state_target
  rng_key: jax.Array
  data_state: dict  # this process's data-iterator state
  config_text: str  # the resolved config the run was saved with
  programs: dict | None = None  # train/programs.py's state (None in checkpoints written before it)


def model_fingerprint(model_cfg, tokenizer_fingerprint: str = "") -> str:
  """'<arch>-L<layers>-D<hidden>-V<vocab>-<hash>': readable, and equal iff model config and tokenizer are."""
  blob = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str) + "|" + tokenizer_fingerprint
  digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
  c = model_cfg
  return f"{c.architecture}-L{c.num_layers}-D{c.hidden_size}-V{c.vocab_size}-{digest}"


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
    self.directory = pathlib.Path(run_dir).absolute() / cio.CHECKPOINTS_DIR
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
                "meta": ocp.JsonCheckpointHandler(), "data": cio.DataStateHandler()}
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._pending: int | None = None  # step of a save whose write may still be running

  def should_save(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0

  def save(self, step: int, *, params, opt_state, rng_key: jax.Array, data_state: dict, config_text: str,
           force: bool = False, programs: dict | None = None) -> bool:
    """Starts writing checkpoint `step` when `should_save(step)` or `force`; returns whether it did.

    Raises NonFiniteError if params or optimizer state hold NaN/Inf, and
    CheckpointWriteError if an earlier asynchronous write failed.
    """
    if not (force or self.should_save(step)):
      return False
    self.wait()
    if step in self.all_steps():
      return False
    trees = {"params": cio.pure(params), "opt_state": cio.pure(opt_state)}
    checksums = cio.finite_checksums(step, trees)  # one pass per tree
    meta = {"step": step, "fingerprint": self.fingerprint, "rng": cio.key_to_json(rng_key), "config": config_text,
            "leaves": {k: len(jax.tree.leaves(t)) for k, t in trees.items()},
            "checksums": {k: [[str(x.dtype), c] for x, c in zip(jax.tree.leaves(t), checksums[k])]
                          for k, t in trees.items()}}
    if programs is not None:
      meta["programs"] = programs
    # Orbax refuses trees without leaves (optax.sgd's state); they hold nothing to save.
    items = {k: ocp.args.StandardSave(t) for k, t in trees.items() if jax.tree.leaves(t)}
    args = ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta), data=cio.DataStateSave(data_state))
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
    if self._pending is not None:
      allocator.release_free_memory()  # the write's host copies, freed now, would stay mapped beside the update
    self._pending = None

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, ascending."""
    return cio.complete_steps(self.directory)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint on disk (a write still in progress does not count)."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore(self, step: int | None = None, *, params_target, opt_state_target) -> RestoredState:
    """Restores checkpoint `step` (default: latest) onto the shapes, dtypes and shardings of the targets.

    Targets are the live params / optimizer state, or ShapeDtypeStructs. Raises
    cio.CheckpointDamagedError when the checkpoint cannot be read or its arrays differ
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
      raise cio.CheckpointDamagedError(f"checkpoint {where}: its metadata cannot be read ({cio.first_line(e)})") from None
    if saved_fingerprint != self.fingerprint:
      raise UserError(f"checkpoint {where} was written for model '{saved_fingerprint}', but this run's model is "
                      f"'{self.fingerprint}'; use the same model and tokenizer, or a fresh run.dir")
    targets = {"params": params_target, "opt_state": opt_state_target}
    saved_items = {}
    for k in targets:
      try:
        saved_items[k] = getattr(self._mgr.item_metadata(step), k, None) if saved_leaves[k] else {}
      except Exception as e:  # pylint: disable=broad-except
        raise cio.CheckpointDamagedError(f"checkpoint {where}: its {k} cannot be read ({cio.first_line(e)})") from None
      if saved_items[k] is None:
        raise cio.CheckpointDamagedError(f"checkpoint {where}: its {k} folder is missing or incomplete")
    cio.check_params_fit(saved_items["params"], params_target, where, saved_fingerprint)
    for k, t in targets.items():
      if len(jax.tree.leaves(cio.pure(t))) != saved_leaves[k]:
        raise UserError(f"checkpoint {where} holds {saved_leaves[k]} {k} arrays, this run has "
                        f"{len(jax.tree.leaves(cio.pure(t)))}; resume with the settings it was saved with")
    saved_opt = sorted(cio.shapes(getattr(saved_items["opt_state"], "tree", saved_items["opt_state"])).values())
    if saved_leaves["opt_state"] and saved_opt != sorted(cio.shapes(cio.pure(opt_state_target)).values()):
      raise UserError(f"checkpoint {where} holds optimizer state of other shapes than this run's "
                      f"optimizer; resume with the settings it was saved with")
    items = {k: ocp.args.StandardRestore(cio.abstract(t)) for k, t in targets.items() if saved_leaves[k]}
    try:
      with cio.quiet_reader_errors():
        out = self._mgr.restore(step, args=ocp.args.Composite(**items, data=cio.DataStateRestore()))
    except UserError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise cio.CheckpointDamagedError(f"checkpoint {where}: its arrays cannot be read ({cio.first_line(e)})") from None
    for k in items:
      bad = cio.checksum_mismatch(out[k], meta.get("checksums", {}).get(k))
      if bad is not None:
        raise cio.CheckpointDamagedError(f"checkpoint {where}: {k} array '{bad}' differs from its saved checksum")
    restored = {k: cio.like(t, out[k]) if k in items else t for k, t in targets.items()}
    return RestoredState(step=step, params=restored["params"], opt_state=restored["opt_state"],
                         rng_key=cio.key_from_json(meta["rng"]), data_state=out.data, config_text=meta["config"],
                         programs=meta.get("programs"))

  def restore_latest_intact(self, *, params_target, opt_state_target, warn=None) -> RestoredState | None:
    """Restores the newest checkpoint that is complete and matches its checksums; None when there is none.

    Each damaged newer checkpoint is reported through `warn` (one line: which and
    why) and moved aside to `<step>.damaged` so that its step can be saved again.
    Raises cio.CheckpointDamagedError when checkpoints exist but none is intact.
    """
    self.wait()
    damaged = []
    for step in reversed(self.all_steps()):
      try:
        restored = self.restore(step, params_target=params_target, opt_state_target=opt_state_target)
      except cio.CheckpointDamagedError as e:
        damaged.append((step, str(e)))
        continue
      for _, message in damaged:
        if warn is not None:
          warn(f"{message}; resuming from the newest intact checkpoint, step {step}")
      self._set_aside(s for s in self.all_steps() if s > step)
      return restored
    if damaged:
      reasons = "; ".join(f"{cio.CHECKPOINTS_DIR}/{s}: {m.split(': ', 1)[-1][:90]}" for s, m in damaged)
      raise cio.CheckpointDamagedError(f"no intact checkpoint in {self.directory} ({reasons}); restore the folder "
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
                                f"({cio.first_line(e)}); {left}")


def _remove_torn_writes(directory: pathlib.Path) -> None:
  """Deletes the temporary folders of writes that never completed (synchronously, unlike Orbax's cleanup)."""
  if jax.process_index() == 0 and directory.is_dir():
    for p in directory.glob(f"*{cio.TMP_SUFFIX}*"):
      shutil.rmtree(p, ignore_errors=True)


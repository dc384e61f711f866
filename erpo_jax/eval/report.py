"""Where evaluation results go: the results JSON and TensorBoard scalars, into folders checked writable first."""

from __future__ import annotations

import json
import os
import pathlib

from tensorboardX import SummaryWriter

from erpo_jax.errors import PathError


def writable(folder: pathlib.Path) -> bool:
  try:
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / f".write-test-{os.getpid()}"
    probe.write_text("ok")
    probe.unlink()
    return True
  except OSError:
    return False


def check_writable(folder: pathlib.Path, what: str) -> None:
  if not writable(folder):
    raise PathError(f"eval results cannot be written to '{folder}' (from {what}): it is not a writable folder; "
                    "give --out <a file in a folder you can write>")


def write_json(path: pathlib.Path, results: dict) -> None:
  """Atomic write: a reader never sees half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(results, indent=2) + "\n")
  os.replace(tmp, path)


def write_tensorboard(folder: pathlib.Path, values: dict[str, float], step: int) -> None:

  writer = SummaryWriter(str(folder))
  try:
    for tag, v in values.items():
      writer.add_scalar(tag, v, step)
  finally:
    writer.close()

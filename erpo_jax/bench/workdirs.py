"""The bench's working folders in the system temp folder, and the removal of those a killed bench left behind.

A bench run keeps its worker specs, a training run folder (`bench rl`: a checkpoint of the whole training state at
its last step, 1.3 GB for the embedded model) and compilation caches in `erpo-bench-*` folders and removes them
when it ends. A bench killed first (SIGKILL, an out-of-memory kill) cannot. Each folder therefore names its owner,
the process id and its start time (so that a later process given the same id is not taken for it), and every
bench first removes the folders whose owner is gone. Folders of other users, or without an owner file, are left.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator

PREFIX = "erpo-bench-"
OWNER_FILE = "owner.json"


def _start_time(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (Linux /proc), or None where it cannot be read."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  return stat[stat.rindex(")") + 2:].split()[19]  # field 22; the command name may hold spaces


def _alive(pid: int, start: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's process of that id: alive, whoever it is
  return start is None or _start_time(pid) in (None, start)


def make(kind: str, root: str | None = None) -> pathlib.Path:
  """A new working folder `erpo-bench-<kind>-*` in `root` (default: the system temp folder) naming its owner."""
  folder = pathlib.Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=root))
  pid = os.getpid()
  (folder / OWNER_FILE).write_text(json.dumps({"pid": pid, "start": _start_time(pid)}))
  return folder


@contextlib.contextmanager
def folder(kind: str, root: str | None = None) -> Iterator[pathlib.Path]:
  """`make`, removed again when the block ends."""
  path = make(kind, root)
  try:
    yield path
  finally:
    shutil.rmtree(path, ignore_errors=True)


def _size(path: pathlib.Path) -> int:
  total = 0
  for dirpath, _, files in os.walk(path):
    for f in files:
      with contextlib.suppress(OSError):
        total += os.lstat(os.path.join(dirpath, f)).st_size
  return total


def remove_stale(root: str | None = None) -> tuple[int, int]:
  """Removes this user's working folders in `root` whose owner process is gone; returns (folders, bytes)."""
  root_path = pathlib.Path(root or tempfile.gettempdir())
  removed = freed = 0
  for path in root_path.glob(f"{PREFIX}*"):
    try:
      if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
        continue
      owner = json.loads((path / OWNER_FILE).read_text())
      pid, start = int(owner["pid"]), owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
      continue
    if _alive(pid, start):
      continue
    size = _size(path)
    shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
      removed, freed = removed + 1, freed + size
  return removed, freed


def announce_stale_removed(root: str | None = None) -> None:
  """`remove_stale`, with one line on stderr when it removed anything."""
  removed, freed = remove_stale(root)
  if removed:
    print(f"bench: removed {removed} working folder{'s' if removed > 1 else ''} ({freed / 2**30:.2f} GiB) in "
          f"{root or tempfile.gettempdir()} left by bench runs that were killed", file=sys.stderr, flush=True)

"""What guards a run folder: a writable folder, its config.yaml, one trainer at a time (run.lock), and a resume with the config the run has.

The lock is an exclusive `flock` on `<run.dir>/run.lock`, which holds the
holder's pid, host and start time; the kernel drops it when the process ends,
however it ends. A lock file left by a process that is gone is taken over with
a warning.

A resume compares the new config with the run's `config.yaml`. Changes of the
fields in RUN_DEFINING change what the run computes (the model, the data and
prompts, the reward, the sampling of the G responses, the ERPO/PPO objective,
the seed); they are refused unless allowed (`--allow-config-change`). Any other
change (optimizer, step count, logging, checkpoints, mesh, performance settings)
is taken. Every changed field is printed in one line either way.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import pathlib
import socket

from erpo_jax.config import Config
from erpo_jax.config_io import dump_config, flatten, safe_yaml
from erpo_jax.errors import PathError, UserError, write_error

LOCK_FILE = "run.lock"


def prepare_run_dir(cfg: Config) -> pathlib.Path:
  """Creates <run.dir> (or checks an existing one is writable) without touching what is in it."""
  run_dir = pathlib.Path(cfg.run.dir)
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".write-test-{os.getpid()}"
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise PathError(f"run.dir '{run_dir}' is not a writable folder ({e.strerror or e}); "
                    f"give run.dir=<a folder you can write>") from None
  return run_dir


def write_config(run_dir: pathlib.Path, cfg: Config) -> None:
  tmp = run_dir / "config.yaml.tmp"
  try:
    tmp.write_text(dump_config(cfg))
    os.replace(tmp, run_dir / "config.yaml")
  except OSError as e:
    tmp.unlink(missing_ok=True)
    raise write_error(run_dir / "config.yaml", e) from None


# Config keys (or whole sections) whose change makes a resumed run a different run.
RUN_DEFINING = (
    "model.path", "model.tokenizer", "model.random_init", "model.seed", "model.dtype", "model.param_dtype",
    "data",  # all but data.num_workers (see RUN_DEFINING_EXCEPT)
    "reward.extract", "reward.correct", "reward.wrong", "reward.format_bonus",
    "rollout.group_size", "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p", "rollout.top_k",
    "erpo",  # all but where its cache lives and whether the reference is a forward or cached
    "ppo",
    "train.seed",
)
RUN_DEFINING_EXCEPT = ("data.num_workers", "erpo.cache_dir", "erpo.reference")


class RunLockedError(UserError):
  """Another trainer holds the run folder."""


def _holder_text(info: dict) -> str:
  since = info.get("since")
  when = f", since {since}" if since else ""
  return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


class RunLock:
  """An exclusive lock on a run folder for the life of this process (or until `release`)."""

  def __init__(self, run_dir, *, warn=None):
    self.path = pathlib.Path(run_dir) / LOCK_FILE
    self._warn = warn
    self._fd: int | None = None

  def acquire(self) -> None:
    import fcntl  # POSIX only: imported where the lock is taken
    for _ in range(10):
      try:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      except OSError as e:
        raise PathError(f"run.dir lock {self.path} cannot be opened ({e.strerror})") from None
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        holder = _read_info(fd)
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
          raise PathError(f"run.dir lock {self.path} cannot be taken ({e.strerror})") from None
        raise RunLockedError(f"run.dir '{self.path.parent}' is in use by another trainer ({_holder_text(holder)}); "
                             f"stop it first, or use another run.dir") from None
      try:
        same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same_file = False
      if not same_file:  # the holder released (removed) the file between our open and flock
        os.close(fd)
        continue
      previous = _read_info(fd)
      me = {"pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
      if previous and previous.get("host") not in (None, me["host"]):
        os.close(fd)
        raise RunLockedError(f"run.dir '{self.path.parent}' was locked by a trainer on another host "
                             f"({_holder_text(previous)}) which this host cannot check; if it is no longer "
                             f"running, delete {self.path}")
      if previous and self._warn is not None:
        self._warn(f"run.dir '{self.path.parent}': taking over the lock of {_holder_text(previous)}, "
                   f"which is no longer running")
      os.ftruncate(fd, 0)
      os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
      os.fsync(fd)
      self._fd = fd
      return
    raise RunLockedError(f"run.dir '{self.path.parent}': the lock {self.path} keeps changing hands")

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      self.path.unlink()  # while still held: a newcomer either sees our lock or a fresh file
    except OSError:
      pass
    os.close(self._fd)
    self._fd = None

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()


def _read_info(fd: int) -> dict:
  try:
    data = os.pread(fd, 4096, 0)
    info = json.loads(data.decode("utf-8")) if data.strip() else {}
    return info if isinstance(info, dict) else {"pid": "?"}
  except (OSError, ValueError):
    return {"pid": "?"}


# ----------------------------------------------------------------------------- config on resume


def run_defining(key: str) -> bool:
  """True when a change of config `key` changes the meaning of a resumed run (see RUN_DEFINING)."""
  hit = lambda names: any(key == n or key.startswith(n + ".") for n in names)
  return hit(RUN_DEFINING) and not hit(RUN_DEFINING_EXCEPT)


def config_changes(saved: dict, new: dict) -> list[tuple[str, object, object]]:
  """(key, saved value, new value) of every leaf that differs; keys only one side has are skipped, and so is
  run.dir (a run folder may be moved)."""
  a, b = flatten(saved), flatten(new)
  return [(k, a[k], b[k]) for k in b if k in a and a[k] != b[k] and k != "run.dir"]


def _short(v) -> str:
  text = json.dumps(v) if not isinstance(v, str) else repr(v)
  return text if len(text) <= 40 else text[:37] + "..."


def check_resume_config(run_dir, cfg, *, saved_text: str = "", allow: bool = False, warn=None) -> None:
  """Compares `cfg` with the run's config.yaml (or `saved_text`, the resumed checkpoint's, when that is missing).

  Prints every changed field through `warn` in one line; raises UserError when a
  run-defining field changed and `allow` is false.
  """
  path = pathlib.Path(run_dir) / "config.yaml"
  saved = None
  for source, read in ((path, lambda: path.read_text(encoding="utf-8") if path.is_file() else ""),
                       ("the checkpoint's config", lambda: saved_text)):
    try:
      text = read()
      saved = safe_yaml(text, str(source))[1] if text else None
    except (OSError, UnicodeDecodeError, UserError):
      saved = None
    if isinstance(saved, dict):
      break
  if not isinstance(saved, dict):
    return
  changes = config_changes(saved, cfg.to_dict())
  if not changes:
    return
  listed = ", ".join(f"{k} {_short(a)} -> {_short(b)}" for k, a, b in changes)
  refused = [k for k, _, _ in changes if run_defining(k)]
  if refused and not allow:
    raise UserError(f"resuming run.dir '{run_dir}' with a changed config ({listed}): {', '.join(refused)} "
                    f"change{'s' if len(refused) == 1 else ''} what the run computes; pass --allow-config-change to "
                    f"resume anyway, or use a fresh run.dir")
  if warn is not None:
    warn(f"resuming run.dir '{run_dir}' with a changed config: {listed}")

"""User-facing errors: one line, exit code 2, no traceback."""

import errno


class UserError(Exception):
  """A mistake in the user's input (config, data, paths).

  The CLI prints `error: <message>` on one line and exits with code 2.
  The message names the field, file and line where known, and what was
  expected.
  """

  exit_code = 2


class ConfigError(UserError):
  """A bad config key or value."""


class DataError(UserError):
  """A malformed data row or data file."""


class PathError(UserError):
  """A missing or unusable file or folder."""


def write_error(path, e: OSError) -> PathError:
  """A one-line PathError for a failed write of `path` (disk full, quota, permissions, read-only file system)."""
  hint = {errno.ENOSPC: "; free some space and run the same command again",
          errno.EDQUOT: "; free some of your quota and run the same command again",
          errno.EFBIG: "; the file size limit (ulimit -f) was reached"}.get(e.errno, "")
  return PathError(f"'{path}' cannot be written ({e.strerror or e}){hint}")


class NonFiniteError(Exception):
  """The loss or gradients became NaN/Inf; carries the step number."""

  exit_code = 3

  def __init__(self, step: int, what: str = "loss"):
    super().__init__(f"non-finite {what} at step {step}; no checkpoint was written from this state")
    self.step = step


# OSErrors of the user's environment (a full disk, permissions, a path that is not what it should be)
# are one line like a UserError. Any other OSError is a bug and keeps its traceback.
USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS,
                         errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG,
                         errno.ELOOP, errno.EMFILE, errno.ENFILE, errno.EIO})

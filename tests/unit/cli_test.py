"""The CLI's one error boundary: a user's mistake is one line on stderr and exit code 2; a bug keeps its traceback."""

import errno

import pytest

from erpo_jax import cli
from erpo_jax.errors import ConfigError

ARGS = ["train", "--config", "configs/tiny.yaml"]


def _main_raising(monkeypatch, exc):
  def dispatch(args):
    raise exc
  monkeypatch.setattr(cli, "_dispatch", dispatch)
  return cli.main(ARGS)


@pytest.mark.parametrize("exc,needle", [
    (OSError(errno.ENOSPC, "No space left on device", "/r/metrics.jsonl"),
     "'/r/metrics.jsonl': No space left on device; free some space"),
    (PermissionError(errno.EACCES, "Permission denied", "/r/eval"), "'/r/eval': Permission denied; check its"),
    (OSError(errno.EROFS, "Read-only file system", "/r/run.lock"), "read-only file system"),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/r/cache/x"), "'/r/cache/x': Not a directory"),
    (ConfigError("x: " + "y" * 5000), "x: yyy"),
])
def test_user_caused_errors_are_one_short_line_and_exit_2(monkeypatch, capsys, exc, needle):
  assert _main_raising(monkeypatch, exc) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("erpo-jax train: error: ")
  assert needle in err and len(err) <= cli.MAX_ERROR_CHARS + 1


@pytest.mark.parametrize("exc", [OSError(errno.EBADF, "Bad file descriptor"), RuntimeError("a bug"),
                                 KeyError("a bug")])
def test_internal_errors_keep_their_traceback(monkeypatch, exc):
  with pytest.raises(type(exc)):
    _main_raising(monkeypatch, exc)


@pytest.mark.parametrize("argv,needle", [
    (["sample", "--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive integer"),
    (["sample", "--prompt", "hi", "--num", "0"], "argument --num: expected a positive integer, got '0'"),
    (["sample", "--prompt", "hi", "--temperature", "-1"], "argument --temperature: expected a finite number >= 0"),
    (["sample", "--prompt", "hi", "--temperature", "inf"], "argument --temperature: expected a finite number >= 0"),
    (["sample"], "the following arguments are required: --prompt"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["trian"], "invalid choice: 'trian'"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, needle):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and needle in err, err

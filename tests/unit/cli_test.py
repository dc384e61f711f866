"""The CLI's one error boundary: a user's mistake is one line on stderr and exit code 2; a bug keeps its traceback."""

import errno
import logging

import pytest

from erpo_jax import cli, cli_logs
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


TINY = "configs/tiny.yaml"
# (subcommand, options) of each subcommand that reads a config.
SUBCOMMANDS = [
    (["train"], ["--config", TINY, "--allow-config-change"]),
    (["eval"], ["--config", TINY, "--checkpoint", "latest"]),
    (["weights"], ["--config", TINY, "--process-id", "0"]),
    (["sample"], ["--config", TINY, "--prompt", "hi", "--num", "2"]),
    (["export"], ["--config", TINY, "--out", "/tmp/x"]),
    (["data", "check"], ["--config", TINY, "--num-processes", "1"]),
    (["bench", "rl"], ["--config", TINY, "--iters", "6", "--warmup", "2"]),
    (["bench", "step"], ["--config", TINY, "--iters", "1"]),
    (["bench", "rollout"], ["--config", TINY, "--warmup", "1"]),
    (["bench"], ["--config", TINY, "--iters", "1"]),
    (["experiment"], ["--config", TINY, "--coordinator", "h:1"]),
    (["analyze"], ["--config", TINY, "--num", "3"]),
]
IDS = [" ".join(head) for head, _ in SUBCOMMANDS]


@pytest.mark.parametrize("head,options", SUBCOMMANDS, ids=IDS)
def test_overrides_before_and_after_the_options_reach_the_config(head, options):
  from erpo_jax.config_io import load_config
  args = cli.parse_args([*head, "erpo.kl_on=response", *options, "train.steps=7"])
  cfg = load_config(args.config, args.overrides)
  # tiny.yaml has kl_on=prompt and steps=4.
  assert (cfg.erpo.kl_on, cfg.train.steps) == ("response", 7)
  assert args.overrides == ["erpo.kl_on=response", "train.steps=7"]


def test_bench_options_and_overrides_interleave_in_command_line_order():
  args = cli.parse_args(["bench", "train.steps=5", "--config", TINY, "--iters", "2", "train.steps=9"])
  assert (args.what, args.iters, args.overrides) == ("all", 2, ["train.steps=5", "train.steps=9"])
  args = cli.parse_args(["bench", "rl", "a.b=1", "--warmup", "0", "c.d=2", "--iters", "3", "e.f=3"])
  assert (args.what, args.warmup, args.iters, args.overrides) == ("rl", 0, 3, ["a.b=1", "c.d=2", "e.f=3"])


@pytest.mark.parametrize("head,options", SUBCOMMANDS[:1] + SUBCOMMANDS[6:7] + SUBCOMMANDS[9:10],
                         ids=IDS[:1] + IDS[6:7] + IDS[9:10])
def test_a_stray_word_after_an_option_is_one_error_line_naming_it(capsys, head, options):
  assert cli.main([*head, "train.steps=3", *options, "train.steps=2", "oops"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "error: override 'oops': expected key=value" in err, err


@pytest.mark.parametrize("argv,needle", [
    (["bench", "rl", "--config", TINY, "x.y=1", "--bogus"], "unrecognized arguments: --bogus"),
    (["analyze", "--config", TINY, "--num", "3", "x.y=1", "-q"], "unrecognized arguments: -q"),
    (["bench", "rll", "--config", TINY], "argument what: invalid choice: 'rll'"),
])
def test_a_stray_flag_or_bench_kind_is_an_argparse_error(capsys, argv, needle):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and needle in err, err


def test_orbax_warning_about_the_trainers_own_checkpoint_wait_is_dropped_and_other_warnings_pass(caplog):
  # A save warns "Waiting for previous save to complete took N seconds" for the wait the loop did after an
  # earlier step's rollout; that step logs it as time/checkpoint_wait, so the CLI drops the warning.
  cli_logs.install()
  absl_logger = logging.getLogger("absl")
  with caplog.at_level(logging.WARNING):
    absl_logger.warning("Waiting for previous save to complete took %f seconds. If this number is high, "
                        "consider checkpointing less frequently.", 6.69)
    absl_logger.warning("Metadata file does not exist: /run/checkpoints/2/params/_CHECKPOINT_METADATA")
    absl_logger.warning("some other warning")
  assert [r.getMessage() for r in caplog.records] == ["some other warning"]

"""Command line: erpo-jax train | eval | weights | sample | export | bench | data check | experiment | analyze."""

from __future__ import annotations

import argparse
import errno
import re
import sys

from erpo_jax import allocator, cli_logs
from erpo_jax.cli_types import positive_float, positive_int, step_variants, temperature
from erpo_jax.errors import USER_ERRNOS, NonFiniteError, UserError
from erpo_jax.parallel import multihost

DEFAULT_CONFIG = "configs/default.yaml"


BENCH_WHAT = ("step", "rollout", "rl", "reference", "all")
# A config override on the command line: a dotted key, '=', a value (config_io.parse_override reads it).
OVERRIDE = re.compile(r"[A-Za-z_][\w.-]*=")


def _add_common(p: argparse.ArgumentParser) -> None:
  p.add_argument("--config", "-c", default=DEFAULT_CONFIG,
                 help="YAML config file, or a name in configs/ (default: %(default)s)")
  p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                 help="config overrides, e.g. erpo.weights=dynamic train.steps=10; before or after the options")
  p.add_argument("--coordinator", default=None,
                 help="multi-host: coordinator address host:port (also from SLURM or TPU metadata)")
  p.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
  p.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")


MAX_ERROR_CHARS = 600  # an error line is cut here: a value in a message can be any size


class _Parser(argparse.ArgumentParser):
  """argparse with its errors (unknown flag, bad value) as one line, exit code 2."""

  def error(self, message):
    self.exit(2, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
  """`text` on one line (whitespace runs become one space), cut to `limit` characters."""
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _os_error_text(e: OSError) -> str:
  what = f"'{e.filename}'" if e.filename else "a file"
  if e.filename2:
    what += f" -> '{e.filename2}'"
  hint = {errno.ENOSPC: "; free some space (or point run.dir elsewhere) and run the same command again",
          errno.EDQUOT: "; free some of your quota and run the same command again",
          errno.EACCES: "; check its permissions", errno.EPERM: "; check its permissions",
          errno.EROFS: "; it is on a read-only file system"}.get(e.errno, "")
  return f"{what}: {e.strerror or e}{hint}"


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="erpo-jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)

  p = sub.add_parser("train", help="train with ERPO or GRPO; resumes an existing run folder")
  _add_common(p)
  p.add_argument("--allow-config-change", action="store_true",
                 help="resume even when the config changes what the run computes (model, data, G, B, ERPO/PPO "
                      "settings, seed); every changed field is printed either way")

  p = sub.add_parser("eval", help="temperature sweep: Avg@k, Pass@k, Pass@1")
  _add_common(p)
  p.add_argument("--checkpoint", default=None,
                 help="a checkpoint step folder, 'latest' (of run.dir), or omit for the untrained model")
  p.add_argument("--out", default=None, help="JSON results file (default: <run.dir>/eval/...json)")

  p = sub.add_parser("weights", help="compute the static question weights and reference prompt cache")
  _add_common(p)

  p = sub.add_parser("sample", help="generate a completion for one prompt")
  _add_common(p)
  p.add_argument("--prompt", required=True, help="user message; wrapped in the chat template")
  p.add_argument("--max-new-tokens", type=positive_int, default=64)
  p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
  p.add_argument("--num", type=positive_int, default=1, help="number of samples")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--checkpoint", default=None, help="a checkpoint folder or 'latest' of run.dir")

  p = sub.add_parser("export", help="write params as a Hugging Face folder (config.json, safetensors, tokenizer)")
  _add_common(p)
  p.add_argument("--checkpoint", default=None, help="a checkpoint folder or 'latest' of run.dir")
  p.add_argument("--out", required=True, help="output folder")

  p = sub.add_parser("data", help="data check: what a data set holds and the prompt length it needs")
  actions = p.add_subparsers(dest="action", required=True)
  _add_common(actions.add_parser("check", help="rows read and skipped (with reasons), prompt-length quantiles in "
                                               "tokens, golds that verify against themselves, a suggested "
                                               "data.max_prompt_tokens"))

  p = sub.add_parser("bench", help="benchmarks: step, rollout, rl, reference, all")
  # Checked in parse_args: `bench --config C key=value` puts the override here.
  p.add_argument("what", nargs="?", default="all", metavar="{" + ",".join(BENCH_WHAT) + "}",
                 help="what to measure (default: all)")
  _add_common(p)
  p.add_argument("--iters", type=positive_int, default=None, help="timed iterations (median reported)")
  p.add_argument("--warmup", type=int, default=None, help="untimed warm-up iterations")
  p.add_argument("--against", default=None, metavar="FILE",
                 help="with rl or all: a peer's summary JSON (scripts/peers/trl_grpo_bench.py --json-out FILE) or "
                      "an earlier bench rl --out FILE (another mode or commit), measured on this machine; adds "
                      "ratios of step, rollout, update, peak RSS (and work, against erpo-jax)")
  p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON lines to FILE")
  p.add_argument("--variants", type=step_variants, default="abcd",
                 help="step: which update variants to time, letters of abcde (default: abcd)")
  p.add_argument("--shared-prefix", choices=["on", "off", "both"], default="both",
                 help="step: time each variant with model.shared_prefix on, off or both (default: both)")
  p.add_argument("--peak-flops", type=positive_float, default=None, metavar="FLOP/S",
                 help="the device's data-sheet dense bfloat16 FLOP/s, for the MFU (known: NVIDIA H100/H200/A100, "
                      "TPU v4/v5/v6e)")
  p.add_argument("--peak-bandwidth", type=positive_float, default=None, metavar="BYTES/S",
                 help="the device's data-sheet memory bandwidth, for the decode floor (known: as --peak-flops)")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="step: also trace one update of each variant into DIR/<variant>_shared_prefix_<on|off>/ "
                      "(trace/, ops.json, ops.txt: each XLA op's time and matmul FLOP/s)")

  p = sub.add_parser("experiment", help="ablation: train variants x seeds, evaluate each, write report.md and plots")
  _add_common(p)
  p.add_argument("--report-only", action="store_true",
                 help="write report.md and plots from what the grid has finished so far; run nothing")

  p = sub.add_parser("analyze", help="question NLL vs the NLL of sampled responses (Pearson, Spearman, scatter)")
  _add_common(p)
  p.add_argument("--checkpoint", default=None,
                 help="a checkpoint step folder, 'latest' (of run.dir), or omit for the untrained model")
  p.add_argument("--num", type=int, default=None, help="training questions (default: experiment.analyze_num)")
  p.add_argument("--out", default=None, help="output folder (default: <run.dir>/analyze/<base|step<k>>)")
  return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line as a Namespace; `key=value` overrides may stand anywhere after the subcommand.

  argparse takes the positional overrides only from the first run of
  positionals, so those after an option come back unparsed: they join
  args.overrides in command-line order. A leftover flag is argparse's usual
  error; any other word is an override without '=', reported by load_config
  like one in the first run (one line naming it, exit 2, before JAX starts).
  """
  parser = build_parser()
  args, rest = parser.parse_known_args(argv)
  flags = [a for a in rest if a.startswith("-")]
  if flags:
    parser.error(f"unrecognized arguments: {' '.join(flags)}")
  if args.command == "bench" and args.what not in BENCH_WHAT:
    if not OVERRIDE.match(args.what):
      choices = ", ".join(repr(w) for w in BENCH_WHAT)
      parser.error(f"argument what: invalid choice: {args.what!r} (choose from {choices})")
    args.overrides, args.what = [args.what, *args.overrides], "all"
  if args.command == "bench" and args.profile is not None and args.what not in ("step", "all"):
    parser.error(f"argument --profile: traces the update: use it with bench step or bench all, not {args.what}")
  if args.command == "bench" and args.against is not None and args.what not in ("rl", "all"):
    parser.error(f"argument --against: compares whole RL steps: use it with bench rl or bench all, not {args.what}")
  args.overrides = [*args.overrides, *rest]
  return args


def _read_data_first(command: str, cfg) -> None:
  """Data mistakes (a bad row, a missing file) fail as config mistakes do, before JAX is imported: the training
  data of a command that trains or reads it, and the eval sets of one that evaluates (a run with
  train.eval_every: at its start, not at its first eval, hours in). The run reads the training source again
  at no cost (data.sources.train_source keeps it)."""
  # Every bench runs on the training prompts; analyze scores training questions.
  trains = command in ("train", "weights", "experiment", "bench", "analyze")
  evaluates = command in ("eval", "experiment") or (command == "train" and cfg.train.eval_every > 0)
  if not (trains or evaluates):
    return
  from erpo_jax.data.sources import make_eval_source, train_source  # no JAX: imported only by the commands above
  if trains:
    train_source(cfg)
  if evaluates:
    for name in cfg.eval.sets:
      make_eval_source(cfg, name)


def _dispatch(args: argparse.Namespace) -> int:
  # Each command imports what it needs here: `erpo-jax --help` and config errors stay fast, without JAX.
  from erpo_jax.parallel import multihost
  from erpo_jax.config_io import load_config

  # Config mistakes fail first: before JAX is imported and before the processes of a job meet.
  cfg = load_config(args.config, args.overrides)
  against = None
  if args.command == "bench" and args.against is not None:
    from erpo_jax.bench.peer import load_peer
    against = load_peer(args.against)  # a bad peer file fails now, not after the measurements
  if args.command == "bench" and args.profile is not None:
    from erpo_jax.bench.profile import make_folder
    make_folder(args.profile)  # an unwritable folder fails now, not after the timings
  if not getattr(args, "report_only", False):
    _read_data_first(args.command, cfg)
  if args.command == "data":
    from erpo_jax.data.check import run_check
    run_check(cfg)
    return 0
  if args.command in ("train", "eval", "weights", "sample", "bench") and cfg.data.max_prompt_tokens == 0:
    from erpo_jax.data.check import resolve_max_prompt_tokens
    cfg = resolve_max_prompt_tokens(cfg)
  from erpo_jax import compile_cache
  compile_cache.setup()  # before anything compiles; the bench's worker processes set it up again
  multihost.maybe_initialize(coordinator=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
  if args.command == "train":
    from erpo_jax.train.loop import train
    train(cfg, allow_config_change=args.allow_config_change)
  elif args.command == "eval":
    from erpo_jax.eval.evaluate import run_eval
    run_eval(cfg, checkpoint=args.checkpoint, out=args.out)
  elif args.command == "weights":
    from erpo_jax.data.reference_cache import run_weights
    run_weights(cfg)
  elif args.command == "sample":
    from erpo_jax.eval.sample import run_sample
    run_sample(cfg, prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
               num=args.num, seed=args.seed, checkpoint=args.checkpoint)
  elif args.command == "export":
    from erpo_jax.model.io.export import run_export
    run_export(cfg, checkpoint=args.checkpoint, out=args.out)
  elif args.command == "bench":
    from erpo_jax.bench.run import run_bench
    run_bench(cfg, what=args.what, iters=args.iters, warmup=args.warmup, against=against, out=args.out,
              variants=args.variants, shared_prefix=args.shared_prefix, peak_flops=args.peak_flops,
              peak_bandwidth=args.peak_bandwidth, profile=args.profile)
  elif args.command == "experiment":
    from erpo_jax.experiment.runner import run_experiment, write_partial_report
    if args.report_only:
      print(f"report: {write_partial_report(cfg)}")
    else:
      run_experiment(cfg)
  elif args.command == "analyze":
    from erpo_jax.experiment.analyze import run_analyze
    run_analyze(cfg, checkpoint=args.checkpoint, num=args.num, out=args.out)
  return 0


def main(argv: list[str] | None = None) -> int:
  if argv is None:  # the command itself
    allocator.reexec_if_needed()
  multihost.set_cpu_xla_threads()  # several CPU devices in XLA_FLAGS: enough threads for their collectives
  args = parse_args(argv)
  cli_logs.install()
  try:
    return _dispatch(args)
  except (UserError, NonFiniteError) as e:  # NonFiniteError names the step; exit code 3 tells it from a mistake
    print(one_line(f"erpo-jax {args.command}: error: {e}"), file=sys.stderr)
    return e.exit_code
  except OSError as e:
    if e.errno not in USER_ERRNOS:
      raise
    print(one_line(f"erpo-jax {args.command}: error: {_os_error_text(e)}"), file=sys.stderr)
    return UserError.exit_code
  except KeyboardInterrupt:
    print(f"erpo-jax {args.command}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())

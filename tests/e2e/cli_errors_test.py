"""End-to-end error boundary: every user mistake below is one stderr line, exit code 2, no traceback.

Each case once ended in a traceback, a hang or a megabyte error line. Most
fail before a model loads (a CLI start each); the rest run the tiny model up to
the write that fails. A full disk is emulated with a file size limit (writes
past it fail with EFBIG, as with ENOSPC).
"""

import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

import tiny_runs

# Runs the rest of argv with every write past $FILE_LIMIT bytes failing (SIGXFSZ ignored, so the write fails).
FILE_LIMIT = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ['FILE_LIMIT']), "
              "resource.getrlimit(resource.RLIMIT_FSIZE)[1])); os.execv(sys.executable, [sys.executable] + sys.argv[1:])")

ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
LIST_BOMB = ("train:\n  steps: [&a [xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx, xxxxxxxx],\n"
             "    &b [*a, *a, *a, *a, *a, *a, *a, *a], &c [*b, *b, *b, *b, *b, *b, *b, *b],\n"
             "    [*c, *c, *c, *c, *c, *c, *c, *c], [*c, *c, *c, *c, *c, *c, *c, *c]]\n")
CONFIG_FILES = {
    "python_tag.yaml": "base: {tiny}\ntrain:\n  steps: !!python/object/apply:os.system ['touch {dir}/pwned']\n",
    "float_tag.yaml": "base: {tiny}\noptim:\n  lr: !!float abc\n",
    "complex_key.yaml": "base: {tiny}\n? [train, steps]\n: 3\n",
    "self_alias.yaml": "base: {tiny}\ntrain: &t\n  steps: *t\n",
    "alias_bomb.yaml": ALIAS_BOMB,
    "list_bomb.yaml": LIST_BOMB,
}
FAST = [
    # (case id, command and arguments ({dir}: this test's folder, {run}: a fresh run folder), needles)
    ("!!python tag in a file", ["train", "--config", "{dir}/python_tag.yaml"],
     ["python_tag.yaml:3", "tags such as '!!python/object/apply:os.system' are not allowed"]),
    ("!!float abc in a file", ["train", "--config", "{dir}/float_tag.yaml"], ["float_tag.yaml:3", "'!!float'"]),
    ("!!float abc override", ["train", "optim.lr=!!float abc"], ["override 'optim.lr=!!float abc'", "'!!float'"]),
    ("complex mapping key", ["train", "--config", "{dir}/complex_key.yaml"],
     ["complex_key.yaml:2", "a mapping key must be a plain value"]),
    ("self-referencing alias", ["train", "--config", "{dir}/self_alias.yaml"], ["an alias refers to itself"]),
    ("alias bomb", ["train", "--config", "{dir}/alias_bomb.yaml"], ["aliases expand to more than 10000 values"]),
    ("list alias bomb", ["train", "--config", "{dir}/list_bomb.yaml"], ["list_bomb.yaml"]),
    ("seed beyond 64 bits", ["train", "train.seed=1180591620717411303424"],
     ["train.seed: expected an integer in [-2**63, 2**63)"]),
    ("odd head_dim for RoPE", ["train", "model.random_init.head_dim=7"],
     ["model.random_init.head_dim: expected an even number"]),
    ("infinite verifier timeout", ["train", "reward.timeout_s=.inf"], ["reward.timeout_s", "got inf"]),
    ("eval.batch_size=0", ["eval", "eval.batch_size=0"], ["eval.batch_size: expected an integer >= 1, got 0"]),
    ("empty run.dir", ["train", "run.dir="], ["run.dir: expected a folder"]),
    ("sample --max-new-tokens 0", ["sample", "--prompt", "hi", "--max-new-tokens", "0"],
     ["--max-new-tokens: expected a positive integer, got '0'"]),
    ("sample --num 0", ["sample", "--prompt", "hi", "--num", "0"], ["--num: expected a positive integer, got '0'"]),
    ("sample --temperature -1", ["sample", "--prompt", "hi", "--temperature", "-1"],
     ["--temperature: expected a finite number >= 0"]),
]
# Cases that load the tiny model first: (id, arguments, file size limit or None, needles).
LOADED = [
    ("erpo.cache_dir is a file", ["train", "erpo.cache_dir={dir}/python_tag.yaml"], None,
     ["erpo.cache_dir", "python_tag.yaml' is a file"]),
    ("eval results into a file's path", ["eval", "--checkpoint", "latest", "--out", "{dir}/float_tag.yaml/r.json"],
     None, ["eval results cannot be written", "float_tag.yaml", "--out"]),
    ("disk full writing the reference cache", ["train"], 4096,
     ["{run}/cache/reference_cache.npz' cannot be written", "File too large"]),
    ("disk full writing config.yaml", ["train", "erpo.weights=none", "erpo.reference=forward"], 1024,
     ["{run}/config.yaml' cannot be written", "File too large"]),
    ("disk full writing metrics.jsonl mid-run", ["train", "erpo.weights=none", "erpo.reference=forward",
                                                 "log.tensorboard=false", "checkpoint.every=0"], 4096,
     ["{run}/metrics.jsonl' cannot be written", "File too large"]),
]
SLOW = {"disk full writing metrics.jsonl mid-run"}  # runs two update steps


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
  d = tmp_path_factory.mktemp("cli_errors")
  for name, text in CONFIG_FILES.items():
    (d / name).write_text(text.format(tiny=tiny_runs.TINY, dir=d))
  return d


def _run(case_id: str, args: list[str], folder: pathlib.Path, file_limit: int | None = None):
  run = folder / f"run-{abs(hash(case_id))}"
  fill = lambda s: s.format(dir=folder, run=run)
  command, rest = args[0], [fill(a) for a in args[1:]]
  config = tiny_runs.TINY
  if "--config" in rest:
    i = rest.index("--config")
    config, rest = rest[i + 1], rest[:i] + rest[i + 2:]
  run_dir = [f"run.dir={run}"] if command in ("train", "eval") else []
  argv = [sys.executable, "-m", "erpo_jax.cli", command, "--config", config, *run_dir, *rest]
  env = tiny_runs.child_env()
  if file_limit is not None:
    argv = [sys.executable, "-c", FILE_LIMIT, *argv[1:]]
    env["FILE_LIMIT"] = str(file_limit)
    # Compilation cache entries are read but not written: one cut short at the limit would stay in the cache.
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = str(1 << 40)
  t0 = time.monotonic()
  proc = subprocess.run(argv, cwd=tiny_runs.REPO, env=env, capture_output=True, text=True, timeout=300)
  return proc, time.monotonic() - t0, run


def _check(proc, needles, fill) -> str:
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and " error: " in lines[0], lines
  assert len(lines[0]) <= 600
  for needle in needles:
    assert fill(needle) in lines[0], (needle, lines[0])
  return lines[0]


@pytest.fixture(scope="module")
def fast_outcomes(folder) -> dict:
  with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
    futures = {c[0]: pool.submit(_run, c[0], c[1], folder) for c in FAST}
  return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name, args, needles", FAST, ids=[c[0] for c in FAST])
def test_a_user_mistake_is_one_line_and_exit_2(name, args, needles, folder, fast_outcomes):
  del args
  proc, seconds, run = fast_outcomes[name]
  _check(proc, needles, lambda s: s.format(dir=folder, run=run))
  assert seconds < 60, f"took {seconds:.0f} s"  # the alias bomb once ran past 20 s
  assert not (folder / "pwned").exists()


@pytest.mark.parametrize("name, args, file_limit, needles",
                         [pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else []) for c in LOADED])
def test_a_mistake_found_after_the_model_loads_is_one_line_and_exit_2(name, args, file_limit, needles, folder):
  proc, _, run = _run(name, args, folder, file_limit)
  _check(proc, needles, lambda s: s.format(dir=folder, run=run))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")
def test_an_unreadable_data_file_and_a_read_only_run_dir_are_one_line(folder, tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_text('{"question": "What is 1+1?", "answer": "#### 2"}\n')
  data.chmod(0)
  proc, _, _ = _run("unreadable", ["train", f"data.source={data}"], folder)
  _check(proc, ["data.jsonl' cannot be read", "Permission denied"], str)
  run = tmp_path / "ro"
  shutil.copytree(tiny_runs.reference_run(), run)
  run.chmod(0o555)
  try:
    argv = [sys.executable, "-m", "erpo_jax.cli", "eval", "--config", tiny_runs.TINY, f"run.dir={run}",
            "--checkpoint", "latest"]
    proc = subprocess.run(argv, cwd=tiny_runs.REPO, env=tiny_runs.child_env(), capture_output=True, text=True,
                          timeout=300)
    _check(proc, ["eval results cannot be written", "--out"], str)
  finally:
    run.chmod(0o755)


def test_eval_of_a_checkpoint_prints_results_and_nothing_on_stderr(tmp_path):
  run = tmp_path / "run"
  shutil.copytree(tiny_runs.reference_run(), run)
  argv = [sys.executable, "-m", "erpo_jax.cli", "eval", "--config", tiny_runs.TINY, f"run.dir={run}",
          *tiny_runs.BASE, "--checkpoint", "latest", "eval.max_problems=2", "eval.temperatures=[1.0]"]
  proc = subprocess.run(argv, cwd=tiny_runs.REPO, env=tiny_runs.child_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
  assert "eval results:" in proc.stdout

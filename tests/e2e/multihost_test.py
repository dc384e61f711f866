"""Multi-host training equals single-host: 2 processes x 2 CPU devices against 1 process x 4 devices.

The end-to-end check runs `erpo-jax train` on configs/tiny.yaml for 3 steps
twice: once as 2 processes joined by jax.distributed on localhost (gloo CPU
collectives, 2 devices each) and once as 1 process with 4 devices. Losses,
metrics, final parameters and the data each process fed must agree. The
pipeline checks build the per-process iterators directly.
"""

import json
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

import tiny_runs
from erpo_jax.parallel import multihost
from erpo_jax.config import Config, DataSection
from erpo_jax.config_io import load_config
from erpo_jax.data.pipeline import make_train_iterator, training_prompts

REPO = tiny_runs.REPO
TINY = str(REPO / "configs" / "tiny.yaml")
STEPS = 3
# The entropy bonus gives step 1 a real gradient: at step 1 the policy is the reference (KL
# gradient 0 up to rounding) and the random model earns no reward, and Adam would scale pure
# rounding noise up to learning-rate-sized steps that differ between any two reduction orders.
OVERRIDES = (f"train.steps={STEPS}", "data.size=8", "checkpoint.every=0", "log.tensorboard=false",
             "log.samples_every=0", "log.progress=false", "log.data_indices=true", "ppo.entropy_coef=0.01")
TOL = 1e-5  # |a - b| <= TOL * max(1, |a|): gradients are summed across devices in another order by gloo
RUN_TIMEOUT_S = 300


def _child_env() -> dict[str, str]:
  """The one-process run's environment: a training subprocess's (tiny_runs.child_env: the suite's compilation
  cache, every program written to it), 4 CPU devices, no cluster variables."""
  env = {k: v for k, v in tiny_runs.child_env().items() if not k.startswith(("SLURM_", "TPU_", "ERPO_"))}
  return multihost.cpu_device_env(env, 4)


def _train_one_and_two_processes(one, two, extra: tuple[str, ...] = ()) -> list[tuple[int, str]]:
  """Trains into `one` as 1 process x 4 devices and into `two` as 2 processes x 2 devices; both must exit 0.

  Returns the two processes' (exit code, output)."""
  env = _child_env()
  t0 = time.monotonic()
  single = subprocess.run([*_train_argv(one), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
  t1 = time.monotonic()
  assert single.returncode == 0, (single.stdout + single.stderr)[-4000:]
  with pytest.MonkeyPatch.context() as mp:
    for k, v in tiny_runs.child_env().items():  # run_local_processes sets devices and drops cluster variables
      mp.setenv(k, v)
    mp.chdir(REPO)
    multi = multihost.run_local_processes([*_train_argv(two), *extra], 2, cpu_devices=2, timeout_s=RUN_TIMEOUT_S)
  t2 = time.monotonic()
  assert [rc for rc, _ in multi] == [0, 0], "\n----\n".join(out[-4000:] for _, out in multi)
  print(f"\n1 process x 4 devices: {t1 - t0:.1f} s; 2 processes x 2 devices: {t2 - t1:.1f} s")
  return multi


def _train_argv(run_dir) -> list[str]:
  return [sys.executable, "-m", "erpo_jax.cli", "train", "--config", TINY, f"run.dir={run_dir}", *OVERRIDES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Trains the tiny model as 1 process x 4 devices and as 2 processes x 2 devices; returns the run folders."""
  root = tmp_path_factory.mktemp("multihost")
  one, two = root / "one_process", root / "two_processes"
  multi = _train_one_and_two_processes(one, two)
  return {"one": one, "two": two, "outputs": [out for _, out in multi]}


def _metrics(run_dir) -> list[dict]:
  from erpo_jax.metrics import read_jsonl
  return read_jsonl(pathlib.Path(run_dir) / "metrics.jsonl")


def _indices(run_dir, process: int) -> list[list[int]]:
  lines = (pathlib.Path(run_dir) / f"data_indices.process{process}.jsonl").read_text().splitlines()
  rows = [json.loads(line) for line in lines]
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  return [r["index"] for r in rows]


def _final_params(run_dir, cfg):
  """The params of the run's latest checkpoint, restored onto this process's single CPU device."""
  from erpo_jax.train.checkpoint_io import restore_params
  from erpo_jax.model.io.loading import load_model
  model, _ = load_model(cfg.model)
  restore_params(model, "latest", run_dir)
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_two_processes_log_the_losses_and_metrics_of_one_process(runs):
  one, two = _metrics(runs["one"]), _metrics(runs["two"])
  # One line per step: process 1 writes no metrics (it would have doubled the lines).
  assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
  for a, b in zip(one, two):
    assert a.keys() == b.keys()
    for k in ("loss/total", "loss/kl", "kl/query", "kl/policy", "entropy/mean", "reward/mean", "reward/std",
              "reward/accuracy", "response/len_mean", "weight/mean", "prompt_nll/mean", "optim/grad_norm"):
      assert k in a, k
    differ = {k: (a[k], b[k]) for k in a
              if not k.startswith(("time/", "perf/", "host/")) and not abs(a[k] - b[k]) <= TOL * max(1.0, abs(a[k]))}
    assert not differ, f"step {a['step']}: {differ}"
  assert one[-1]["kl/query"] > 1e-4  # the policy has moved: the comparison is not of zeros
  # Console output comes from process 0 only.
  assert "jax.distributed: 2 processes" in runs["outputs"][0]
  assert "jax.distributed" not in runs["outputs"][1]


@pytest.mark.slow
def test_two_processes_end_with_the_params_of_one_process(runs):
  cfg = load_config(TINY, list(OVERRIDES))
  one, two = _final_params(runs["one"], cfg), _final_params(runs["two"], cfg)
  from erpo_jax.model.io.loading import load_model
  init = nnx.to_pure_dict(nnx.state(load_model(cfg.model)[0], nnx.Param))
  max_abs = lambda a, b: max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(
      np.asarray(x, np.float32) - np.asarray(y, np.float32)))), a, b)))
  assert max_abs(one, two) < TOL
  assert max_abs(one, init) > 100 * TOL  # training moved the params well beyond the tolerance


@pytest.mark.slow
def test_each_process_fed_a_disjoint_slice_and_together_the_global_batch(runs):
  cfg = load_config(TINY, list(OVERRIDES))
  whole = _indices(runs["one"], 0)
  per_process = [_indices(runs["two"], p) for p in range(2)]
  for t in range(STEPS):
    p0, p1 = per_process[0][t], per_process[1][t]
    assert len(p0) == len(p1) == cfg.data.batch_size // 2
    assert not set(p0) & set(p1)
    assert p0 + p1 == whole[t]  # process p holds rows [p*B/2, (p+1)*B/2) of the global batch


@pytest.mark.slow
def test_two_process_checkpoint_resumes_each_process_at_its_slice_of_the_next_batch(runs):
  from erpo_jax.model.io.loading import load_tokenizer
  cfg = load_config(TINY, list(OVERRIDES))
  tokenizer = load_tokenizer(cfg.model)
  data_dir = pathlib.Path(runs["two"]) / "checkpoints" / str(STEPS) / "data"
  single = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
  batches = [next(single) for _ in range(STEPS + 2)]
  assert [b.index.tolist() for b in batches[:STEPS]] == _indices(runs["one"], 0)
  resumed = []
  for p in range(2):
    it = make_train_iterator(cfg, tokenizer, process_index=p, process_count=2)
    it.set_state(json.loads((data_dir / f"process_{p}-of-2.json").read_text()))
    resumed.append([next(it).index.tolist() for _ in range(2)])
  assert [resumed[0][t] + resumed[1][t] for t in range(2)] == [b.index.tolist() for b in batches[STEPS:]]


# ----------------------------------------------------------------------------- the pipeline alone


@pytest.fixture(scope="module")
def tokenizer():
  from erpo_jax.config import ModelSection
  from erpo_jax.model.io.loading import load_tokenizer
  return load_tokenizer(ModelSection(path="builtin:smollm2-135m-instruct"))


def _data_cfg(tokenizer, on_overlong: str) -> Config:
  data = DataSection(size=40, levels=(1, 2, 3), batch_size=4, on_overlong=on_overlong)
  if on_overlong == "skip":
    lengths = sorted(len(t) for _, t in training_prompts(Config(data=data), tokenizer))
    data = DataSection(size=40, levels=(1, 2, 3), batch_size=4, on_overlong="skip",
                       max_prompt_tokens=lengths[3 * len(lengths) // 4])  # about a quarter are skipped
  return Config(data=data)


@pytest.mark.parametrize("processes, on_overlong", [(2, "truncate"), (4, "truncate"), (2, "skip"), (4, "skip")])
def test_process_slices_of_every_batch_make_up_the_single_process_batch(tokenizer, processes, on_overlong):
  cfg = _data_cfg(tokenizer, on_overlong)
  steps = 25  # 40 records in batches of 4: two reshuffles
  single = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
  whole = [next(single) for _ in range(steps)]
  iters = [make_train_iterator(cfg, tokenizer, process_index=p, process_count=processes) for p in range(processes)]
  local = [[next(it) for _ in range(steps)] for it in iters]
  b = cfg.data.batch_size // processes
  for t in range(steps):
    slices = [local[p][t] for p in range(processes)]
    assert all(len(s.index) == b for s in slices)
    assert len(set(np.concatenate([s.index for s in slices]).tolist())) == cfg.data.batch_size  # disjoint
    assert np.concatenate([s.index for s in slices]).tolist() == whole[t].index.tolist()
    assert sum((s.prompt_tokens for s in slices), []) == whole[t].prompt_tokens
  if on_overlong == "skip":
    assert single.skipped_overlong > 0
    assert all(it.skipped_overlong == single.skipped_overlong for it in iters)  # counted over global batches


@pytest.mark.parametrize("on_overlong", ["truncate", "skip"])
def test_each_process_resumes_its_slice_exactly(tokenizer, on_overlong):
  cfg = _data_cfg(tokenizer, on_overlong)
  single = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
  whole = [next(single).index.tolist() for _ in range(20)]
  resumed = []
  for p in range(2):
    it = make_train_iterator(cfg, tokenizer, process_index=p, process_count=2)
    for _ in range(7):  # mid-epoch
      next(it)
    state = json.loads(json.dumps(it.get_state()))
    again = make_train_iterator(cfg, tokenizer, process_index=p, process_count=2)
    again.set_state(state)
    resumed.append([next(again).index.tolist() for _ in range(13)])
  assert [resumed[0][t] + resumed[1][t] for t in range(13)] == whole[7:]


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_draws_the_rounds_and_logs_the_metrics_of_one_process(tmp_path):
  # The random model earns no reward, so no group has spread: every step draws its one extra round on every
  # process (the collective agrees) and fills the batch with the dropped groups of round 0.
  extra = ("rollout.dynamic_sampling=true", "rollout.max_extra_rounds=1")
  one, two = tmp_path / "one", tmp_path / "two"
  _train_one_and_two_processes(one, two, extra)
  a_rows, b_rows = _metrics(one), _metrics(two)
  assert len(a_rows) == len(b_rows) == STEPS
  for a, b in zip(a_rows, b_rows):
    assert a["sampling/extra_rounds"] == b["sampling/extra_rounds"] == 1
    assert a["sampling/extra_prompts"] == b["sampling/extra_prompts"] == 2  # data.batch_size prompts, globally
    assert a["sampling/unfilled_groups"] == b["sampling/unfilled_groups"] == 2
    differ = {k: (a[k], b[k]) for k in a
              if not k.startswith(("time/", "perf/", "host/")) and not abs(a[k] - b[k]) <= TOL * max(1.0, abs(a[k]))}
    assert not differ, f"step {a['step']}: {differ}"
  read = lambda d, p: [json.loads(l) for l in (d / f"data_indices.process{p}.jsonl").read_text().splitlines()]
  whole, parts = read(one, 0), [read(two, p) for p in range(2)]
  for t in range(STEPS):  # each process drew its own slice of both rounds; together, the one process's draws
    assert sorted(parts[0][t]["drawn"] + parts[1][t]["drawn"]) == sorted(whole[t]["drawn"])
    assert parts[0][t]["index"] + parts[1][t]["index"] == whole[t]["index"]

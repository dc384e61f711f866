"""Multi-host start-up: flags, SLURM, TPU pod metadata or the environment -> jax.distributed."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence

from erpo_jax.errors import ConfigError

DEFAULT_PORT = 12355  # coordinator port under SLURM unless ERPO_COORDINATOR_PORT is set

_initialized = False  # jax.distributed may be initialised once per process


@dataclasses.dataclass(frozen=True)
class Launch:
  """How this process joins the job; with source "tpu" JAX reads the other fields from the TPU metadata."""
  source: str  # "flags" | "env" | "slurm" | "tpu"
  coordinator: str | None = None  # "host:port" of process 0's coordination service
  num_processes: int | None = None  # P
  process_id: int | None = None  # in [0, P)
  local_device_ids: tuple[int, ...] | None = None  # devices this process may use; None = all


# --- pure parsing


def expand_nodelist(nodelist: str) -> list[str]:
  """Expands a SLURM hostlist, e.g. "node[01-03,07],gpu-a[1-2]" -> node01 node02 node03 node07 gpu-a1 gpu-a2.

  Ranges keep the zero padding of their start ("01-03"); several bracket
  groups in one name expand to their product ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2).
  """
  items = re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", nodelist)  # top-level comma-separated names
  if not items or ",".join(items) != nodelist:
    raise ConfigError(f"SLURM nodelist '{nodelist}': expected names like node[01-04,07],other")
  hosts = []
  for item in items:
    parts = re.split(r"\[([^\]]*)\]", item)  # even indices: literal text, odd: bracket bodies
    choices = [[p] if k % 2 == 0 else _expand_ranges(p, nodelist) for k, p in enumerate(parts)]
    hosts.extend("".join(combo) for combo in itertools.product(*choices))
  return hosts


def _expand_ranges(body: str, nodelist: str) -> list[str]:
  out = []
  for piece in body.split(","):
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
    if not m:
      raise ConfigError(f"SLURM nodelist '{nodelist}': bad range '{piece}' (expected N or N-M)")
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if int(hi) < int(lo):
      raise ConfigError(f"SLURM nodelist '{nodelist}': range '{piece}' ends before it starts")
    out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
  return out


def parse_coordinator(address: str, where: str = "--coordinator") -> tuple[str, int]:
  """Splits "host:port" (or "[v6addr]:port") into (host, port); ConfigError names `where`."""
  m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d+)", address.strip())
  if not m or not 0 < int(m.group(2)) < 65536:
    raise ConfigError(f"{where}: expected host:port with port in 1..65535, got '{address}'")
  return m.group(1), int(m.group(2))


def _env_int(env: Mapping[str, str], name: str) -> int | None:
  raw = env.get(name)
  if raw is None or raw.strip() == "":
    return None
  try:
    return int(raw)
  except ValueError:
    raise ConfigError(f"environment variable {name}: expected an integer, got '{raw}'") from None


def _slurm_port(env: Mapping[str, str]) -> int:
  port = _env_int(env, "ERPO_COORDINATOR_PORT")
  port = DEFAULT_PORT if port is None else port
  if not 0 < port < 65536:
    raise ConfigError(f"environment variable ERPO_COORDINATOR_PORT: expected 1..65535, got {port}")
  return port


def _slurm_nodelist(env: Mapping[str, str]) -> str | None:
  # The step's list inside srun (its first node runs task 0), else the job's.
  for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
    if env.get(name):
      return env[name]
  return None


def _slurm_local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
  """One device per task when SLURM packs several tasks on a node without binding GPUs itself.

  With one task per node (the launch scripts' layout) all local devices stay visible.
  """
  local_id, tasks = _env_int(env, "SLURM_LOCALID"), _env_int(env, "SLURM_NTASKS")
  nodes = _env_int(env, "SLURM_STEP_NUM_NODES") or _env_int(env, "SLURM_JOB_NUM_NODES")
  if local_id is None or tasks is None or nodes is None or tasks <= nodes:
    return None
  visible = env.get("CUDA_VISIBLE_DEVICES", "")
  if visible and len(visible.split(",")) == 1:
    return None
  return (local_id,)


def detect(env: Mapping[str, str], coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None) -> Launch | None:
  """Decides how to start from the CLI flags and the environment; None means single process.

  Order: explicit flags (missing ones filled from ERPO_* then SLURM
  variables), then ERPO_COORDINATOR/ERPO_NUM_PROCESSES/ERPO_PROCESS_ID,
  then SLURM (SLURM_NTASKS > 1), then a TPU pod (TPU_WORKER_HOSTNAMES or
  TPU_PROCESS_ADDRESSES listing several hosts, or ERPO_TPU_POD=1).
  ERPO_DISTRIBUTED=0 turns detection off (flags still count). A launch
  with one process is no launch: None.
  """
  flags_given = any(v is not None for v in (coordinator, num_processes, process_id))
  if not flags_given and env.get("ERPO_DISTRIBUTED", "").strip().lower() in ("0", "off", "false", "no"):
    return None
  slurm_tasks = _env_int(env, "SLURM_NTASKS")
  in_slurm = slurm_tasks is not None and slurm_tasks > 1 and "SLURM_PROCID" in env
  if flags_given or env.get("ERPO_COORDINATOR"):
    source = "flags" if flags_given else "env"
  elif in_slurm:
    source = "slurm"
  elif _is_tpu_pod(env):
    return Launch(source="tpu")
  else:
    return None
  # Values not given come from ERPO_* first, then from SLURM.
  nodelist = _slurm_nodelist(env) if in_slurm else None
  if not coordinator:
    coordinator = env.get("ERPO_COORDINATOR") or (
        f"{expand_nodelist(nodelist)[0]}:{_slurm_port(env)}" if nodelist else None)
  if num_processes is None:
    num_processes = _env_int(env, "ERPO_NUM_PROCESSES")
    num_processes = slurm_tasks if num_processes is None and in_slurm else num_processes
  if process_id is None:
    process_id = _env_int(env, "ERPO_PROCESS_ID")
    process_id = _env_int(env, "SLURM_PROCID") if process_id is None and in_slurm else process_id
  missing = [name for name, v in (("--coordinator (or ERPO_COORDINATOR, SLURM_JOB_NODELIST)", coordinator),
                                  ("--num-processes (or ERPO_NUM_PROCESSES)", num_processes),
                                  ("--process-id (or ERPO_PROCESS_ID)", process_id)) if v is None]
  if missing:
    raise ConfigError(f"multi-host start-up: {', '.join(missing)} not given; "
                      "give --coordinator, --num-processes and --process-id together")

  names = {"flags": ("--coordinator", "--num-processes", "--process-id"),
           "env": ("ERPO_COORDINATOR", "ERPO_NUM_PROCESSES", "ERPO_PROCESS_ID"),
           "slurm": ("SLURM coordinator", "SLURM_NTASKS", "SLURM_PROCID")}[source]
  parse_coordinator(coordinator, names[0])
  if num_processes < 1:
    raise ConfigError(f"{names[1]}: expected >= 1, got {num_processes}")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"{names[2]}: expected 0 <= process id < {num_processes} processes, got {process_id}")
  if num_processes == 1:
    return None
  return Launch(source=source, coordinator=coordinator.strip(), num_processes=num_processes,
                process_id=process_id, local_device_ids=_slurm_local_device_ids(env))


def _is_tpu_pod(env: Mapping[str, str]) -> bool:
  if env.get("ERPO_TPU_POD", "").strip() == "1":
    return True
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  return len([h for h in hosts.split(",") if h.strip()]) > 1


def _tpu_vm_host_count() -> int:
  """Hosts in this Cloud TPU slice from the VM metadata server; 0 off a TPU VM or when unreachable."""
  from jax._src import (
    cloud_tpu_init,  # set at `import jax` when TPU chips and libtpu are present; jax: see below
  )
  if not cloud_tpu_init.running_in_cloud_tpu_vm or os.environ.get("TPU_SKIP_MDS_QUERY"):
    return 0
  host = os.environ.get("GCE_METADATA_IP", "metadata.google.internal")
  req = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/worker-network-endpoints",
                               headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(req, timeout=5) as resp:
      return len([w for w in resp.read().decode().split(",") if w.strip()])
  except OSError:
    return 0


# --- start-up


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
  """Calls `jax.distributed.initialize` when flags or the environment describe a multi-process job.

  Must run before any JAX computation. Returns True when this process is
  now part of a multi-process job (also on a repeated call), False for a
  single-process run, where nothing is done. Bad values raise ConfigError.
  """
  global _initialized
  if _initialized:
    return True
  launch = detect(os.environ, coordinator, num_processes, process_id)
  import jax  # config mistakes are reported before jax is imported (cli), so only here
  if launch is None and _tpu_vm_host_count() > 1:
    launch = Launch(source="tpu")
  if launch is None:
    return False
  # CPU processes need a cross-process collective library (gloo ships with jaxlib);
  # it is inert on GPU/TPU. A user's own choice through the environment wins.
  if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if launch.source == "tpu":
    jax.distributed.initialize()
  else:
    # All three values are known: JAX's own cluster detection would only
    # override the visible devices (SLURM: device 0 per task), so it is off.
    jax.distributed.initialize(coordinator_address=launch.coordinator, num_processes=launch.num_processes,
                               process_id=launch.process_id, local_device_ids=launch.local_device_ids,
                               cluster_detection_method="deactivate")
  _initialized = True
  log(f"jax.distributed: {jax.process_count()} processes from {launch.source}"
      f"{' via ' + launch.coordinator if launch.coordinator else ''}, {jax.device_count()} devices")
  return True


def is_main() -> bool:
  """True on process 0, the one that prints logs and writes metrics. Call after start-up."""
  import jax  # config mistakes are reported before jax is imported (cli), so only here
  return jax.process_index() == 0


def warn(msg: str) -> None:
  """Prints `warning: msg` as one line on stderr, on process 0 only. Call after start-up."""
  import jax  # config mistakes are reported before jax is imported (cli), so only here
  if jax.process_index() == 0 or os.environ.get("ERPO_LOG_ALL") == "1":
    print(f"warning: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)


def log(msg: str) -> None:
  """Prints `msg` on process 0 only, or on every process (prefixed "[p/P]") when ERPO_LOG_ALL=1.

  Call after start-up: asking JAX for the process index starts its backends.
  """
  import jax  # config mistakes are reported before jax is imported (cli), so only here
  index, count = jax.process_index(), jax.process_count()
  if os.environ.get("ERPO_LOG_ALL") == "1":
    print(f"[{index}/{count}] {msg}" if count > 1 else msg, flush=True)
  elif index == 0:
    print(msg, flush=True)


def cpu_xla_threads(num_devices: int, cores: int | None = None) -> int:
  """Threads for XLA's CPU client (PJRT_NPROC) in a process of `num_devices` CPU devices: 4 a device, and never
  fewer than the cores. With XLA's default, max(cores, devices), a device's thread blocked in one collective
  can leave another collective of the same program waiting for a free thread while the other devices wait in
  it: the process stalls until XLA ends it (jaxlib 0.10.2, 8 devices on 2 cores, two processes building and
  running sharded updates side by side: each stalled within its first 21 updates; with 32 threads, none of
  392 did)."""
  return max(4 * num_devices, cores or os.cpu_count() or 1)


def cpu_device_env(env: Mapping[str, str], num_devices: int) -> dict[str, str]:
  """`env` for a process on `num_devices` CPU devices: JAX_PLATFORMS=cpu, the device count added to the
  XLA_FLAGS it has (its other XLA flags kept), and PJRT_NPROC at `cpu_xla_threads` unless `env` sets it."""
  flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}".strip()
  out = {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
  set_cpu_xla_threads(out)
  return out


def set_cpu_xla_threads(environ=os.environ) -> int | None:
  """Sets PJRT_NPROC to `cpu_xla_threads` in `environ` when its XLA_FLAGS ask for several CPU devices and it
  sets no PJRT_NPROC of its own; returns the count set, else None. Call before JAX starts its backends (XLA
  reads the variable once, when it makes its CPU client)."""
  found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", environ.get("XLA_FLAGS", ""))
  if not found or int(found[-1]) < 2 or environ.get("PJRT_NPROC"):
    return None
  threads = cpu_xla_threads(int(found[-1]))
  environ["PJRT_NPROC"] = str(threads)
  return threads


def run_local_processes(argv: Sequence[str], num_processes: int, *, cpu_devices: int | None = None,
                        timeout_s: float = 120.0) -> list[tuple[int, str]]:
  """Runs `argv + [--coordinator 127.0.0.1:<free port>, --num-processes P, --process-id i]` for i < P, on CPU.

  The Python twin of `launch/local.sh --processes P`, for tests; SLURM_*,
  TPU_* and ERPO_* variables are dropped so only the flags count. After
  the first failure, or at `timeout_s`, the others are killed (exit -9).
  Returns (exit code, stdout+stderr) per process, in process order.
  """
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TPU_", "ERPO_"))}
  env["JAX_PLATFORMS"] = "cpu"
  if cpu_devices:
    env = cpu_device_env(env, cpu_devices)
  with tempfile.TemporaryDirectory() as tmp:
    logs = [open(os.path.join(tmp, f"process-{i}.log"), "w+") for i in range(num_processes)]
    procs = [subprocess.Popen([*argv, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
                               "--process-id", str(i)], env=env, stdout=logs[i], stderr=subprocess.STDOUT)
             for i in range(num_processes)]
    deadline = time.monotonic() + timeout_s
    while None in (codes := [p.poll() for p in procs]):
      if time.monotonic() > deadline or any(c not in (None, 0) for c in codes):
        for p in procs:
          if p.poll() is None:
            p.kill()
      time.sleep(0.1)
    for f in logs:
      f.seek(0)
    out = [(p.returncode, f.read()) for p, f in zip(procs, logs)]
    for f in logs:
      f.close()
  return out

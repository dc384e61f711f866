"""Device probes for the bench: synchronised median timing, peak memory, matmul peak and memory bandwidth."""

from __future__ import annotations

import mmap
import os
import resource
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from erpo_jax import allocator
from erpo_jax.bench import machine
from erpo_jax.data.pipeline import make_train_iterator
from erpo_jax.model import cpu_kernel
from erpo_jax.model.io.loading import load_model
from erpo_jax.model.llama import dense


def timed(fn: Callable[[], Any], *, iters: int, warmup: int) -> list[float]:
  """Wall seconds of `iters` calls of fn after `warmup` untimed ones.

  Each call's outputs are waited for with jax.block_until_ready, so the time
  covers the device work and not just the asynchronous dispatch.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return times


def median(xs: list[float]) -> float:
  return float(statistics.median(xs))


def load_average() -> list[float]:
  """1, 5 and 15 minute load averages of the host (it is shared: read figures next to it)."""
  return [round(x, 2) for x in os.getloadavg()]


def host_window() -> tuple:
  """The host's load average and CPU times now: the start of a timing, for `host_window_fields`."""
  return load_average(), machine.cpu_times()


def host_window_fields(start: tuple) -> dict[str, Any]:
  """A timing's host fields from `host_window()` to now: load_avg_start, load_avg_end and steal_share (the
  share of the host's CPU time the hypervisor gave to other machines meanwhile)."""
  load0, cpu0 = start
  return {"load_avg_start": load0, "load_avg_end": load_average(), "steal_share": machine.steal_share(cpu0)}


def peak_memory() -> dict[str, int | None]:
  """Peak resident memory of this process, and of the device where the backend reports it.

  ru_maxrss is in KiB on Linux. peak_device_bytes is memory_stats()['peak_bytes_in_use']
  of device 0 (GPU/TPU); None on CPU, where device memory is host memory (in the RSS).
  """
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
  device = None
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    stats = dev.memory_stats() or {}
    device = stats.get("peak_bytes_in_use")
  return {"peak_rss_bytes": int(rss), "peak_children_rss_bytes": int(children),
          "peak_device_bytes": None if device is None else int(device)}


def device_info() -> dict[str, Any]:
  """Where a record was measured: the device, the host's CPU model and vector ISA (and the ISA XLA_FLAGS
  holds XLA's CPU code to, if any), its CPU count, the host allocator, whether transparent huge pages are off, and
  whether decode's products run through erpo-jax's CPU kernel (`model/cpu_kernel.py`)."""
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": dev.device_kind, "device_count": jax.device_count(),
          "cpu_model": machine.cpu_model(), "cpu_isa": machine.cpu_isa(), "xla_max_isa": machine.xla_max_isa(),
          "host_cpus": os.cpu_count(), "allocator": allocator.in_use(),
          "huge_pages": allocator.huge_pages(), "freed_memory": allocator.freed_memory(),
          "cpu_kernel": cpu_kernel.status()}


def matmul_peak(n: int, dtype, *, iters: int = 10, warmup: int = 2) -> dict[str, float]:
  """FLOP/s of one [n, n] @ [n, n] product in `dtype`: 2 n^3 / the fastest of `iters` runs.

  The fastest, not the median: a floor must not sit above what the device can
  do, and the first products of a process run slower (on a 2-core CPU the
  median of 3 after 1 warm-up read 272-386 GFLOP/s where the fastest of 10
  after 2 read 341-410). The product is the model's (`llama.dense`): on the
  CPU bfloat16 with float32 sums rounded once, elsewhere in the input type.
  """
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
  mm = jax.jit(lambda x, y: dense(x, y, 1))
  t = min(timed(lambda: mm(a, b), iters=iters, warmup=warmup))
  return {"n": n, "time_s": t, "flops_per_s": 2.0 * n ** 3 / t}


def read_bandwidth(num_bytes: int, *, iters: int = 5, warmup: int = 1) -> dict[str, float]:
  """Bytes/s of a jitted sum over a float32 array of `num_bytes` (one read of every byte).

  Also the bytes/s of x + 1 (a read and a write of every byte, counted twice).
  """
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  plus = jax.jit(lambda v: v + 1.0)
  t_read = median(timed(lambda: total(x), iters=iters, warmup=warmup))
  t_copy = median(timed(lambda: plus(x), iters=iters, warmup=warmup))
  return {"array_bytes": int(x.nbytes), "read_bytes_per_s": x.nbytes / t_read,
          "copy_bytes_per_s": 2 * x.nbytes / t_copy}


def first_touch_s_per_gib(num_bytes: int = 64 << 20) -> float:
  """Seconds per GiB the kernel takes to hand this process fresh memory: one write to each 4 KiB page of a new
  anonymous mapping of `num_bytes` (no huge pages unless the system forces them), timed.

  On bare metal this is the kernel zeroing pages, about 0.1-0.3 s per GiB. On a virtual machine whose host
  takes back the memory its guest frees (a balloon, free page reporting), a page the guest has not touched
  lately faults on the host too: on the 2-core AMD EPYC VM it read 0.13 s for a GiB once and 3-11 s in the
  same hour. An erpo-jax step takes gigabytes of fresh pages (XLA allocates each program's temporary buffer
  anew on every call, and mimalloc hands memory freed for over a second back to the kernel), so its time
  follows this figure where a peer that keeps its memory does not.
  """
  page = mmap.PAGESIZE
  buf = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  try:
    pages = np.frombuffer(buf, np.uint8)[::page]
    t0 = time.perf_counter()
    pages[:] = 1
    seconds = time.perf_counter() - t0
    del pages
  finally:
    buf.close()
  return seconds * (1 << 30) / num_bytes


def device_peaks() -> dict[str, Any]:
  """Matmul peaks (float32, bfloat16) and read bandwidth of device 0, sized for its platform."""
  accel = jax.devices()[0].platform != "cpu"
  n = 8192 if accel else 2048
  f32 = matmul_peak(n, jnp.float32)
  bf16 = matmul_peak(n, jnp.bfloat16)
  bw = read_bandwidth((1 << 30) if accel else (256 << 20))
  return {"matmul_n": n, "peak_flops_per_s_float32": f32["flops_per_s"], "peak_flops_per_s_bfloat16": bf16["flops_per_s"],
          "matmul_time_s_float32": f32["time_s"], "matmul_time_s_bfloat16": bf16["time_s"], **bw,
          "first_touch_s_per_gib": first_touch_s_per_gib()}


def load_model_and_prompts(cfg):
  """(model, tokenizer, the first batch's prompt token lists) of a config, as training would see them."""

  model, tokenizer = load_model(cfg.model)
  data = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
  prompts = next(data).prompt_tokens
  data.close()
  return model, tokenizer, prompts

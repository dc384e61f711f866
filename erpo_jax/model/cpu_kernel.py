"""Decode's products and attention, and the update's group attention, on the CPU through kernels of our own,
in float32.

Why: a decode step multiplies a few dozen columns by every weight matrix, so it
is bound by how fast the weights stream in. XLA's CPU dot reads them at about
6-7 GB/s at 32 columns, whatever the operand layout (docs/PERFORMANCE.md,
"Where the rollout stops on a CPU"). `cpu_decode.cc` reads W packed in
panels of R rows stored k-major (`pack`, once per `generate`), each panel one
contiguous stream times R x 32 register accumulators, and shares the panels out
over XLA's own intra-op threads.

The attention (`group_attention`, over a `GroupCache`) writes each row's new key
and value and attends in one call: XLA's ops for it scored every response slot
of the cache, live or not, and wrote each new key across Dh x K x N cache lines
(keys slot-minor). The kernel keeps response keys slot-major like the values,
reads only the slots the mask marks up to the last, and hands the output back
column-major for the next product.

The update's attention (`model/group_attention.py`: a group's response rows over
their prompt's keys and their own) has a forward and a backward here
(TRAIN_ATTENTION_TARGETS): XLA ran it as batched products of [R, Dh] blocks at a
third of the matmul peak or less, with transposes around them.

It is C++ against the XLA FFI headers jaxlib ships, built on first use with the
host's C++ compiler ($CXX, else c++, g++ or clang++) for this CPU
(-march=native: AVX-512F, or AVX2 with FMA) and kept in
$XDG_CACHE_HOME/erpo-jax/native (~/.cache/erpo-jax/native), keyed by the
source, the compiler, jaxlib and the CPU. Decode and the update use it when the
backend is the CPU with one device, the compute dtype is float32 and it builds;
ERPO_JAX_CPU_KERNEL=off turns it off. Otherwise they run XLA's ops as before
(one line on stderr says why when a build fails).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import jaxlib

from erpo_jax.model.kv_cache import KVCache

ENV = "ERPO_JAX_CPU_KERNEL"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.cc")
TARGET = "erpo_decode_matmul_v1"  # the names compiled programs call; a new ABI takes a new name
PACK_TARGET = "erpo_pack_panels_v2"
ATTENTION_TARGET = "erpo_group_decode_attention_v1"
TRAIN_ATTENTION_TARGETS = ("erpo_group_attention_fwd_v1", "erpo_group_attention_bwd_v1")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")

_lib: tuple[ctypes.CDLL, int] | None = None
_why_not: str | None = None
_forced: bool | None = None
_lock = threading.Lock()  # one build and one registration, whichever thread traces first


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Panels:
  """A weight matrix packed for the kernel: panels [ceil(rows / R), in, R], panels[p, k, i] = W[p R + i, k]."""
  panels: jax.Array
  rows: int = dataclasses.field(metadata=dict(static=True))


def cache_dir(environ=os.environ) -> str:
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "erpo-jax", "native")


def compiler(environ=os.environ) -> str | None:
  if environ.get("CXX"):
    return shutil.which(environ["CXX"])
  return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _cpu_id() -> str:
  """This CPU's model and feature flags: -march=native code is built for them."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor() + platform.machine()


def build(cxx: str, out_dir: str, extra_flags: tuple[str, ...] = (), source: str = SOURCE) -> str:
  """Builds the kernel (`source`: this package's, or another checkout's to compare with) into out_dir (once per
  key) and returns the library's path; raises RuntimeError with the compiler's last lines when it does not
  build."""
  with open(source, "rb") as f:
    text = f.read()
  version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
  key = hashlib.sha256(b"\0".join([text, repr((version, jaxlib.__version__, FLAGS, extra_flags)).encode(),
                                  _cpu_id().encode()])).hexdigest()[:20]
  path = os.path.join(out_dir, f"decode-{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(out_dir, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  cmd = [cxx, *FLAGS, *extra_flags, "-I", jax.ffi.include_dir(), "-o", tmp, source]
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode != 0:
    if os.path.exists(tmp):
      os.unlink(tmp)
    tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    raise RuntimeError(f"{os.path.basename(cxx)} exited with {done.returncode}: {tail[-400:]}")
  os.replace(tmp, path)  # whole or absent, whatever other processes build beside this one
  return path


def _writable_dir(path: str) -> str | None:
  """path, made if need be, when this process can write it; else None (the kernel is then built for this
  process only, in a temporary folder)."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  return path if os.access(path, os.W_OK) else None


def register_train_attention(lib: ctypes.CDLL, targets: tuple[str, str]) -> None:
  """Registers a built library's update attention, forward and backward, under the target names `targets`."""
  for target, fn in zip(targets, (lib.ErpoGroupAttentionForward, lib.ErpoGroupAttentionBackward)):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")


@contextlib.contextmanager
def train_attention_targets(targets: tuple[str, str]):
  """The update attention traced inside calls `targets` (registered with `register_train_attention`): two
  builds of the library compared in one process."""
  global TRAIN_ATTENTION_TARGETS
  saved, TRAIN_ATTENTION_TARGETS = TRAIN_ATTENTION_TARGETS, tuple(targets)
  try:
    yield
  finally:
    TRAIN_ATTENTION_TARGETS = saved


def _load() -> tuple[ctypes.CDLL, int] | None:
  """The built kernel and its panel height R, registered with XLA; None (and `_why_not`) when it cannot be."""
  with _lock:
    return _load_locked()


def _load_locked() -> tuple[ctypes.CDLL, int] | None:
  global _lib, _why_not
  if _lib is not None or _why_not is not None:
    return _lib
  cxx = compiler()
  if cxx is None:
    _why_not = "no C++ compiler (set CXX or install g++)"
  elif platform.machine().lower() not in ("x86_64", "amd64"):
    _why_not = f"no kernel for {platform.machine()}"
  else:
    out_dir = _writable_dir(cache_dir())
    scratch = None if out_dir else tempfile.mkdtemp(prefix="erpo-jax-native-")
    try:
      path = build(cxx, out_dir or scratch)
      lib = ctypes.cdll.LoadLibrary(path)
      jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.ErpoDecodeMatmul), platform="cpu")
      jax.ffi.register_ffi_target(PACK_TARGET, jax.ffi.pycapsule(lib.ErpoPackPanels), platform="cpu")
      jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.ErpoGroupDecodeAttention), platform="cpu")
      register_train_attention(lib, TRAIN_ATTENTION_TARGETS)
      _lib = (lib, int(lib.erpo_panel_rows()))
    except (RuntimeError, OSError) as e:
      _why_not = f"it did not build ({e})"
    finally:
      if scratch:  # a loaded library stays mapped: nothing is left in the temporary folder
        shutil.rmtree(scratch, ignore_errors=True)
  if _why_not is not None:
    print(f"erpo-jax: decoding and the update's attention with XLA's ops, not the CPU kernel: {_why_not}; "
          f"{ENV}=off skips the kernel", file=sys.stderr, flush=True)
  return _lib


def require() -> None:
  """Builds and registers the library (once), or raises RuntimeError saying why it cannot be."""
  if _load() is None:
    raise RuntimeError(f"the CPU kernel library is not available: {_why_not}")


def wanted() -> bool:
  if _forced is not None:
    return _forced
  return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "false", "no")


def usable(dtype) -> bool:
  """Whether decode's products and the update's attention of this compute dtype run through the kernel (builds
  it on the first yes)."""
  return (wanted() and jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu"
          and jax.device_count() == 1 and _load() is not None)


def status() -> str:
  """One phrase for bench output: "on (12-row panels, float32 decode and update attention)" or "off: <why>"."""
  if not wanted():
    return f"off: {ENV}=off" if _forced is None else "off"
  if jax.default_backend() != "cpu" or jax.device_count() != 1:
    return "off: only for one CPU device"
  return (f"on ({_lib[1]}-row panels, float32 decode and update attention)" if _load() is not None
          else f"off: {_why_not}")


@contextlib.contextmanager
def forced(on: bool):
  """Within the block, decode takes (on) or skips (off) the kernel whatever the environment says; programs
  traced inside keep what they took."""
  global _forced
  before, _forced = _forced, on
  try:
    yield
  finally:
    _forced = before


def _pack(w_Lx: jax.Array, layer: int, rows: int, fan_in: int, w_rows: bool) -> Panels:
  R = _load()[1]
  out = jax.ShapeDtypeStruct((-(-rows // R), fan_in, R), jnp.float32)
  return Panels(jax.ffi.ffi_call(PACK_TARGET, out)(w_Lx.astype(jnp.float32), w_rows=w_rows, layer=layer), rows)


def pack(w_inxout: jax.Array, layer: int | None = None) -> Panels:
  """W as stored, [in, out] (x @ W), into the kernel's panels (by the kernel: XLA's CPU transposes run at
  about 1.5 GB/s); or, given layer, matrix `layer` of a stack [L, in, out], read in place (a slice of the
  stack would be a copy)."""
  w = w_inxout[None] if layer is None else w_inxout
  return _pack(w, layer or 0, w.shape[2], w.shape[1], False)


def pack_rows(w_outxin: jax.Array) -> Panels:
  """W given as [out, in] rows (the unembedding, [V, D]) into the kernel's panels."""
  return _pack(w_outxin[None], 0, w_outxin.shape[0], w_outxin.shape[1], True)


def matmul(w: Panels, xT_inxN: jax.Array) -> jax.Array:
  """W @ x: [rows, N] float32, from the panels and column-major activations x [in, N]."""
  out = jax.ShapeDtypeStruct((w.rows, xT_inxN.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(w.panels, xT_inxN.astype(jnp.float32))


class GroupCache(NamedTuple):
  """`kv_cache.GroupKVCache` in the form `group_attention` reads: the prompts' cache (B rows, keys [B, K, Dh, P],
  values [B, K, P, Dh]) and each row's response keys and values, both [N, K, M, Dh], so a step writes one
  contiguous run of Dh floats per row and head. Slots are numbered as in a `GroupKVCache`."""

  prompt: KVCache
  k: jax.Array  # [N, K, M, Dh]
  v: jax.Array  # [N, K, M, Dh]

  @staticmethod
  def for_groups(prompt: KVCache, group_size: int, response_slots: int) -> "GroupCache":
    """`GroupKVCache.for_groups` in this form."""
    B, K, Dh, _ = prompt.k.shape
    zeros = lambda: jnp.zeros((B * group_size, K, response_slots, Dh), jnp.float32)
    return GroupCache(prompt, zeros(), zeros())


def group_attention(qT_HDhxN: jax.Array, kT_KDhxN: jax.Array, vT_KDhxN: jax.Array, cosT_DhxN: jax.Array,
                    sinT_DhxN: jax.Array, cache: GroupCache, attend_NxT: jax.Array, slot, *,
                    target: str = ATTENTION_TARGET) -> tuple[jax.Array, GroupCache]:
  """`llama.apply_rope` of the columns' queries and new keys (half-split, each row's table [Dh, N]), then
  `GroupKVCache.write` of their keys and values into slot `slot` (>= P) and `attend` of their queries, in one
  kernel call: (the attention's output [H Dh, N], column-major, and the updated cache, whose response buffers
  the call updates in place). `target` names another registered build of the kernel (tests)."""
  o = jax.ShapeDtypeStruct(qT_HDhxN.shape, jnp.float32)
  k = jax.ShapeDtypeStruct(cache.k.shape, jnp.float32)
  call = jax.ffi.ffi_call(target, (o, k, k), input_output_aliases={7: 1, 8: 2})
  f32 = lambda x: x.astype(jnp.float32)
  oT, rk, rv = call(f32(qT_HDhxN), f32(kT_KDhxN), f32(vT_KDhxN), f32(cosT_DhxN), f32(sinT_DhxN),
                    f32(cache.prompt.k), f32(cache.prompt.v), cache.k, cache.v, attend_NxT.astype(bool),
                    jnp.asarray(slot, jnp.int32))
  return oT, GroupCache(cache.prompt, rk, rv)

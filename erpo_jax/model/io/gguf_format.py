"""The GGUF container (llama.cpp's model file), read directly: header, metadata and tensor table.

Layout (little-endian, versions 2 and 3): "GGUF", u32 version, u64 tensor count, u64 metadata count; then each
metadata entry as (string key, u32 value type, value); then each tensor as (string name, u32 dims, u64 dims innermost
first, u32 ggml type, u64 offset); then, at the next multiple of `general.alignment` (32 by default), the tensor
data, each tensor at its offset. A string is a u64 byte count and UTF-8 bytes; an array is a u32 element type, a u64
count and the elements.

The gguf package's reader builds an object per field part (a SmolLM2 file's 98,000 vocabulary and merge strings
took 3 s); here numeric arrays are one numpy view each and strings one slice each. Values come back as the gguf
package's `ReaderField.contents()` gives them: Python ints, floats, bools, strs, and lists of those; an array of
arrays comes back as nested lists (the package flattens it).
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type -> numpy dtype of a scalar of that type (8 string and 9 array are read apart)
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class FormatError(ValueError):
  """The bytes are not a GGUF file this reader understands; the message says where."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """One tensor's entry: `shape` as GGUF lists it (innermost first), `data` its bytes in the mapped file."""

  name: str
  tensor_type: int  # ggml type id (gguf.GGMLQuantizationType)
  shape: tuple[int, ...]
  data: np.ndarray  # uint8 [nbytes], a view of the memory-mapped file


class _Cursor:
  def __init__(self, buf: np.ndarray):
    self.buf, self.mv, self.pos = buf, memoryview(buf), 0

  def take(self, n: int) -> int:
    start = self.pos
    if n < 0 or start + n > len(self.buf):
      raise FormatError(f"truncated at byte {start}: {n} more bytes expected, the file has {len(self.buf)}")
    self.pos = start + n
    return start

  def u32(self) -> int:
    return struct.unpack_from("<I", self.mv, self.take(4))[0]

  def u64(self) -> int:
    return struct.unpack_from("<Q", self.mv, self.take(8))[0]

  def string(self) -> str:
    n = self.u64()
    start = self.take(n)
    return bytes(self.mv[start:start + n]).decode("utf-8", errors="replace")

  def numbers(self, etype: int, count: int) -> list:
    dt = _SCALARS.get(etype)
    if dt is None:
      raise FormatError(f"unknown value type {etype} before byte {self.pos}")
    return np.frombuffer(self.buf, dt, count, self.take(count * np.dtype(dt).itemsize)).tolist()

  def value(self, vtype: int):
    if vtype == _STRING:
      return self.string()
    if vtype == _ARRAY:
      etype, count = self.u32(), self.u64()
      if etype == _STRING:
        return [self.string() for _ in range(count)]
      if etype == _ARRAY:  # arrays of arrays: each element carries its own type and count
        return [self.value(_ARRAY) for _ in range(count)]
      return self.numbers(etype, count)
    return self.numbers(vtype, 1)[0]


def read(path: str) -> tuple[dict, dict[str, TensorInfo]]:
  """(metadata without the GGUF.* header fields, tensors by name) of the file at `path`, memory-mapped.

  Raises FormatError for bytes that are not a little-endian GGUF file of version 2 or 3, or that end early."""
  if os.path.getsize(path) == 0:
    raise FormatError("the file is empty")
  buf = np.memmap(path, dtype=np.uint8, mode="r")
  c = _Cursor(buf)
  if bytes(buf[c.take(4):4]) != MAGIC:
    raise FormatError(f"no GGUF magic: the file starts with {bytes(buf[:4])!r}, expected {MAGIC!r}")
  version = c.u32()
  if version not in VERSIONS:
    swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
    if swapped in VERSIONS:
      raise FormatError(f"big-endian GGUF (version {swapped}) is not supported: convert it to little-endian")
    raise FormatError(f"GGUF version {version} is not supported: expected one of {VERSIONS}")
  n_tensors, n_kv = c.u64(), c.u64()
  metadata = {}
  for _ in range(n_kv):
    key = c.string()
    metadata[key] = c.value(c.u32())
  entries = {}
  for _ in range(n_tensors):
    name = c.string()
    if name in entries:
      raise FormatError(f"tensor {name} is listed twice")
    dims = tuple(c.u64() for _ in range(c.u32()))
    entries[name] = (dims, c.u32(), c.u64())
  align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
  if align <= 0:
    raise FormatError(f"general.alignment is {align}: expected a positive number")
  data_start = -(-c.pos // align) * align
  return metadata, {name: _tensor(buf, data_start, name, dims, ttype, offset)
                    for name, (dims, ttype, offset) in entries.items()}


def _tensor(buf: np.ndarray, data_start: int, name: str, dims: tuple[int, ...], ttype: int, offset: int) -> TensorInfo:
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # the type table; a light import

  try:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
  except (ValueError, KeyError):
    raise FormatError(f"tensor {name}: unknown ggml type {ttype}") from None
  elements = int(np.prod(dims, dtype=np.int64))
  if elements % block:
    raise FormatError(f"tensor {name}: {elements} elements is not a whole number of type {ttype}'s blocks of {block}")
  nbytes = elements // block * type_size
  start = data_start + offset
  if start + nbytes > len(buf):
    raise FormatError(f"tensor {name}: its {nbytes} bytes at byte {start} run past the end of the file "
                      f"({len(buf)} bytes)")
  return TensorInfo(name, ttype, dims, buf[start:start + nbytes])

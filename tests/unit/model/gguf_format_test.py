"""The GGUF container reader agrees with the gguf package's reader, value for value and byte for byte."""

import gguf
import numpy as np
import pytest

from erpo_jax.errors import PathError
from erpo_jax.model.io import gguf as gguf_io
from erpo_jax.model.io import gguf_format
from erpo_jax.model.io.sources import builtin_path

V = gguf.GGUFValueType


def package_view(path):
  """(metadata, {name: (type, shape, bytes)}) as the gguf package reads the file."""
  r = gguf.GGUFReader(path)
  metadata = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
  tensors = {t.name: (int(t.tensor_type), tuple(int(n) for n in t.shape), np.asarray(t.data).reshape(-1).view(np.uint8))
             for t in r.tensors}
  return metadata, tensors


def assert_same_as_package(path):
  want_meta, want_tensors = package_view(path)
  meta, tensors = gguf_format.read(path)
  assert list(meta) == list(want_meta)
  for key, value in want_meta.items():
    assert meta[key] == value and type(meta[key]) is type(value), key
  assert list(tensors) == list(want_tensors)
  for name, (ttype, shape, data) in want_tensors.items():
    t = tensors[name]
    assert (t.tensor_type, t.shape) == (ttype, shape), name
    np.testing.assert_array_equal(t.data, data, err_msg=name)


def write(path, *, endianess=gguf.GGUFEndian.LITTLE, alignment=None):
  w = gguf.GGUFWriter(path, "llama", endianess=endianess)
  if alignment is not None:
    w.add_uint32("general.alignment", alignment)
  for key, value, vtype in [("u8", 200, V.UINT8), ("i8", -100, V.INT8), ("u16", 60000, V.UINT16),
                            ("i16", -30000, V.INT16), ("u32", 4_000_000_000, V.UINT32), ("i32", -2_000_000_000, V.INT32),
                            ("f32", 1e-5, V.FLOAT32), ("u64", 2**63 + 5, V.UINT64), ("i64", -2**62, V.INT64),
                            ("f64", 0.1, V.FLOAT64), ("yes", True, V.BOOL), ("no", False, V.BOOL),
                            ("text", "héllo {{ x }}\n", V.STRING)]:
    w.add_key_value(f"t.{key}", value, vtype)
  w.add_key_value("t.tokens", ["<|im_start|>", "Ġthe", "ä½ł", "", "a b"], V.ARRAY, sub_type=V.STRING)
  w.add_key_value("t.types", [1, 3, 1, 6], V.ARRAY, sub_type=V.INT32)
  w.add_key_value("t.scores", [-1.5, 0.0, 2.25], V.ARRAY, sub_type=V.FLOAT32)
  w.add_key_value("t.flags", [True, False, True], V.ARRAY, sub_type=V.BOOL)
  rng = np.random.default_rng(0)
  w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
  w.add_tensor("b.weight", rng.standard_normal((7,)).astype(np.float16))
  q = rng.standard_normal((4, 64)).astype(np.float32)
  w.add_tensor("c.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
               raw_dtype=gguf.GGMLQuantizationType.Q8_0)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return q


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_equals_the_gguf_package_on_every_value_type_and_tensor_type(tmp_path, alignment):
  path = str(tmp_path / "m.gguf")
  write(path, alignment=alignment)
  assert_same_as_package(path)
  meta, _ = gguf_format.read(path)
  assert meta["t.u64"] == 2**63 + 5 and meta["t.f32"] == float(np.float32(1e-5)) and meta["t.yes"] is True
  assert meta["t.tokens"] == ["<|im_start|>", "Ġthe", "ä½ł", "", "a b"] and meta["t.types"] == [1, 3, 1, 6]


def test_quantized_tensor_dequantizes_through_the_loader_as_written(tmp_path):
  path = str(tmp_path / "m.gguf")
  q = write(path)
  _, tensors = gguf_format.read(path)
  t = tensors["c.weight"]
  assert t.shape == (64, 4) and t.data.nbytes == 4 * 64 // 32 * 34  # Q8_0: 32 values in 34 bytes
  got = gguf.quants.dequantize(np.asarray(t.data).reshape(4, -1), gguf.GGMLQuantizationType.Q8_0)
  np.testing.assert_allclose(got, q, atol=np.abs(q).max() / 100)


def test_reader_equals_the_gguf_package_on_the_embedded_smollm2():
  assert_same_as_package(builtin_path("builtin:smollm2-135m-instruct"))


@pytest.mark.parametrize("damage,message", [
    (lambda b: b"", "the file is empty"),
    (lambda b: b"GGML" + b[4:], "no GGUF magic"),
    (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "GGUF version 7 is not supported"),
    (lambda b: b[:200], "truncated at byte"),
    (lambda b: b[:-100], "run past the end of the file"),  # into the last tensor, past its padding
])
def test_a_damaged_file_is_one_clear_path_error(tmp_path, damage, message):
  good = str(tmp_path / "good.gguf")
  write(good)
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(damage(open(good, "rb").read()))
  with pytest.raises(PathError, match=f"bad.gguf: not a readable GGUF file: .*{message}"):
    gguf_io.open_gguf(str(bad))


def test_a_big_endian_file_is_refused_by_name(tmp_path):
  path = str(tmp_path / "be.gguf")
  write(path, endianess=gguf.GGUFEndian.BIG)
  with pytest.raises(gguf_format.FormatError, match="big-endian GGUF"):
    gguf_format.read(path)


def test_an_array_of_arrays_reads_as_nested_lists(tmp_path):
  path = str(tmp_path / "nested.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  assert gguf_format.read(path)[0]["t.nested"] == [[1, 2], [3]]


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F16],
                         ids=lambda q: q.name)
def test_dequantize_equals_the_gguf_package_bit_for_bit(qtype):
  rng = np.random.default_rng(0)
  block, type_size = gguf.GGML_QUANT_SIZES[qtype]
  values = (rng.standard_normal((3, 5, 4 * block)) * rng.choice([1e-3, 1.0, 40.0], size=(3, 5, 1))).astype(np.float32)
  quantized = gguf.quants.quantize(values, qtype)
  # Every byte pattern of the quants too (all nibbles, int8 -128), under finite random scales.
  raw = rng.integers(0, 256, size=(6, 4 * type_size), dtype=np.uint8)
  if qtype in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
    blocks = raw.reshape(-1, type_size)
    scales = 2 if qtype == gguf.GGMLQuantizationType.Q8_0 else 4
    blocks[:, :scales] = rng.uniform(-2, 2, size=(len(blocks), scales // 2)).astype(np.float16).view(np.uint8)
  for rows in (quantized, raw):
    want = np.asarray(gguf.quants.dequantize(rows, qtype), np.float32)
    got = gguf_io.dequantize(rows, qtype)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

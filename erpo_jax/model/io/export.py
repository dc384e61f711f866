"""Writes a model as a Hugging Face checkpoint folder (config.json, safetensors, tokenizer) that transformers loads."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from erpo_jax.errors import UserError
from erpo_jax.model import llama
from erpo_jax.model.io import hf, loading
from erpo_jax.model.tokenizer import Tokenizer
from erpo_jax.train.checkpoint_io import restore_params

MARKER = "erpo_jax_export.json"  # names the files an export wrote, so a re-export may replace them
_DTYPES = {"float32": np.float32, "bfloat16": np.dtype(llama.as_dtype("bfloat16"))}


def export_hf(model: llama.Transformer, tokenizer: Tokenizer | None, out_dir: str, *, dtype: str = "float32",
              max_shard_bytes: int = 4 << 30, source: str = "") -> str:
  """Writes config.json, generation_config.json, model.safetensors (or shards + index) and the tokenizer.

  Tensors take Hugging Face names and [out, in] layouts (`hf.hf_tensors`). One
  parameter at a time is brought to the host, so host memory stays near one
  shard. On several processes all take part in the gathers and process 0 writes.
  Returns `out_dir`.
  """
  if dtype not in _DTYPES:
    raise UserError(f"export dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
  writer = jax.process_index() == 0
  if writer:
    _prepare(out_dir)
  cfg = model.cfg
  if tokenizer is not None:
    cfg = dataclasses.replace(cfg, bos_token_id=tokenizer.bos_id, eos_token_ids=tokenizer.eos_ids,
                              pad_token_id=tokenizer.pad_id)
  params = _HostParams(model, _DTYPES[dtype])
  files, weight_map, shard, size, total = [], {}, {}, 0, 0

  def flush():
    nonlocal shard, size
    if shard and writer:
      name = f"model-{len(files) + 1:05d}.safetensors.part"
      _save_safetensors(shard, os.path.join(out_dir, name))
      files.append(name)
      weight_map.update({k: name for k in shard})
    shard, size = {}, 0

  for name, w in hf.hf_tensors(cfg, params):
    if size and size + w.nbytes > max_shard_bytes:
      flush()
    shard[name] = w
    size += w.nbytes
    total += w.nbytes
  flush()
  if not writer:
    return out_dir
  final = _rename_shards(out_dir, files, weight_map, total)
  _write_json(os.path.join(out_dir, "config.json"), hf.config_json(cfg, dtype))
  eos = list(cfg.eos_token_ids)
  _write_json(os.path.join(out_dir, "generation_config.json"),
              {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
               "pad_token_id": cfg.pad_token_id})
  written = ["config.json", "generation_config.json", *final]
  if tokenizer is not None:
    tokenizer.save(out_dir)
    written += ["tokenizer.json", "tokenizer_config.json"]
  _write_json(os.path.join(out_dir, MARKER), {
      "files": written, "source": source, "dtype": dtype,
      "tokenizer_fingerprint": tokenizer.fingerprint() if tokenizer is not None else None})
  return out_dir


def run_export(cfg, checkpoint: str | None, out: str) -> str:
  """`erpo-jax export`: the model of cfg.model, with the params of `checkpoint` if given, as a HF folder."""

  model, tokenizer = loading.load_model(cfg.model)
  source = cfg.model.path
  if checkpoint is not None:

    restore_params(model, checkpoint, cfg.run.dir)
    source = f"{source} + checkpoint {checkpoint} of {cfg.run.dir}"
  export_hf(model, tokenizer, out, source=source)
  if jax.process_index() == 0:
    print(f"exported {source} to {out}")
  return out


class _HostParams:
  """Our stacked parameters by name, fetched to the host in `dtype` when asked for (one at a time)."""

  def __init__(self, model: llama.Transformer, dtype):
    self.model, self.dtype = model, dtype

  def __getitem__(self, name: str) -> np.ndarray:
    x = getattr(self.model, name)[...]
    if not x.is_fully_addressable:
      x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x)).astype(self.dtype)


def _prepare(out_dir: str) -> None:
  """Makes `out_dir`; refuses a non-empty folder unless a previous export, whose files it removes."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise UserError(f"--out {out_dir}: is a file: expected a new or empty folder")
  entries = os.listdir(out_dir) if os.path.isdir(out_dir) else []
  if entries and MARKER not in entries:
    raise UserError(f"--out {out_dir}: folder is not empty and holds no previous export ({MARKER}): "
                    "expected a new or empty folder")
  if entries:
    with open(os.path.join(out_dir, MARKER)) as f:
      previous = json.load(f)["files"]
    for name in [*previous, MARKER, "model.safetensors.index.json"]:
      path = os.path.join(out_dir, os.path.basename(name))
      if os.path.isfile(path):
        os.remove(path)
  os.makedirs(out_dir, exist_ok=True)


def _rename_shards(out_dir: str, files: list[str], weight_map: dict, total: int) -> list[str]:
  """model.safetensors for one shard; model-0000i-of-0000n.safetensors + index for several."""
  n = len(files)
  final = {f: "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
           for i, f in enumerate(files)}
  for f, g in final.items():
    os.replace(os.path.join(out_dir, f), os.path.join(out_dir, g))
  if n == 1:
    return ["model.safetensors"]
  _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
              {"metadata": {"total_size": total}, "weight_map": {k: final[f] for k, f in weight_map.items()}})
  return [*final.values(), "model.safetensors.index.json"]


def _save_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
  import safetensors.numpy  # optional until a model is exported

  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})  # "pt": transformers expects it


def _write_json(path: str, obj: dict) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")

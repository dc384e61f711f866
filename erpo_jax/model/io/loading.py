"""Loads the model and tokenizer that `model.path` names: a builtin, a .gguf file, a Hugging Face folder or random."""

from __future__ import annotations

import dataclasses
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
from erpo_jax.model.io.sources import load_tokenizer, source
from erpo_jax.model.tokenizer import Tokenizer

# (logical axis names, shape) of a parameter -> where it lives, e.g. erpo_jax.parallel.sharding_for_axes(mesh);
# None = the default device.
ShardingFor = Callable[[tuple[str, ...], tuple[int, ...]], "jax.sharding.Sharding | None"]


# ---------------------------------------------------------------------- model


def load_model(model: config_lib.ModelSection, *,
               sharding_for: ShardingFor | None = None) -> tuple[llama.Transformer, Tokenizer]:
  """(Transformer, Tokenizer) for `model`, with its dtype, param_dtype and remat.

  With `sharding_for`, every parameter is placed straight onto its sharding as it is read.
  """
  tokenizer = load_tokenizer(model)
  kind, where = source(model.path, "model.path")
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
  kind, where = source(model.path, "model.path")
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


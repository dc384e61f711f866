"""Hugging Face checkpoint folders: config.json <-> ModelConfig, *.safetensors <-> layer-stacked parameters.

Hugging Face stores one tensor per layer in torch's [out, in] layout; erpo-jax
stacks the layers on a leading L axis in [in, out] layout with heads split out:

    q_proj.weight [H*Dh, D]  ->  wq[l] = W.T.reshape(D, H, Dh)       (k, v: K heads)
    o_proj.weight [D, H*Dh]  ->  wo[l] = W.T.reshape(H, Dh, D)
    q_proj.bias   [H*Dh]     ->  bq[l] = b.reshape(H, Dh)            (Qwen2)
    gate/up_proj  [F, D]     ->  w_gate[l], w_up[l] = W.T  [D, F]
    down_proj     [D, F]     ->  w_down[l] = W.T           [F, D]
    lm_head       [V, D]     ->  lm_head = W.T             [D, V]
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Callable, Iterator

import numpy as np

from erpo_jax.errors import PathError, UserError
from erpo_jax.model.config import ModelConfig, RopeScaling

# Checkpoint class -> our architecture. Mistral has Llama's layout (its sliding
# window is not applied: exact for sequences shorter than the window).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

# Our stacked name -> (Hugging Face name inside `model.layers.{l}.`, layout kind).
LAYER_PARAMS = {
    "wq": ("self_attn.q_proj.weight", "in_heads"),
    "wk": ("self_attn.k_proj.weight", "in_heads"),
    "wv": ("self_attn.v_proj.weight", "in_heads"),
    "wo": ("self_attn.o_proj.weight", "out_heads"),
    "bq": ("self_attn.q_proj.bias", "bias"),
    "bk": ("self_attn.k_proj.bias", "bias"),
    "bv": ("self_attn.v_proj.bias", "bias"),
    "w_gate": ("mlp.gate_proj.weight", "transpose"),
    "w_up": ("mlp.up_proj.weight", "transpose"),
    "w_down": ("mlp.down_proj.weight", "transpose"),
    "attn_norm": ("input_layernorm.weight", "same"),
    "mlp_norm": ("post_attention_layernorm.weight", "same"),
}
GLOBAL_PARAMS = {
    "embed": ("model.embed_tokens.weight", "same"),
    "final_norm": ("model.norm.weight", "same"),
    "lm_head": ("lm_head.weight", "transpose"),
}

Reader = Callable[[str], np.ndarray]


def param_names(cfg: ModelConfig) -> list[str]:
  """Our parameter names that `cfg` has (biases only with attention_bias, lm_head only untied)."""
  names = [n for n in LAYER_PARAMS if cfg.attention_bias or not n.startswith("b")]
  names += [n for n in GLOBAL_PARAMS if n != "lm_head" or not cfg.tie_word_embeddings]
  return names


def hf_name(name: str, layer: int | None = None) -> str:
  if name in GLOBAL_PARAMS:
    return GLOBAL_PARAMS[name][0]
  return f"model.layers.{layer}.{LAYER_PARAMS[name][0]}"


def to_ours(kind: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  D, Dh = cfg.hidden_size, cfg.head_dim
  if kind == "in_heads":
    return w.T.reshape(D, -1, Dh)
  if kind == "out_heads":
    return w.T.reshape(-1, Dh, D)
  if kind == "bias":
    return w.reshape(-1, Dh)
  return w.T if kind == "transpose" else w


def to_hf(kind: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  D = cfg.hidden_size
  if kind == "in_heads":
    return w.reshape(D, -1).T
  if kind == "out_heads":
    return w.reshape(-1, D).T
  if kind == "bias":
    return w.reshape(-1)
  return w.T if kind == "transpose" else w


def stacked_params(cfg: ModelConfig, read: Reader, dtype) -> Iterator[tuple[str, np.ndarray]]:
  """(our name, array in `dtype`) one parameter at a time, layers stacked on axis 0.

  Only one stacked parameter is alive here at a time, so a caller that places
  each on its devices before asking for the next holds ~1x the model in host
  memory, never 2x.
  """
  for name in param_names(cfg):
    if name in GLOBAL_PARAMS:
      # A fresh copy: never a view of a memory-mapped file that a later export could overwrite.
      yield name, np.array(to_ours(GLOBAL_PARAMS[name][1], read(hf_name(name)), cfg), dtype=dtype, order="C")
      continue
    kind = LAYER_PARAMS[name][1]
    first = to_ours(kind, read(hf_name(name, 0)), cfg)
    out = np.empty((cfg.num_layers, *first.shape), dtype)
    out[0] = first
    for l in range(1, cfg.num_layers):
      out[l] = to_ours(kind, read(hf_name(name, l)), cfg)
    yield name, out


def hf_tensors(cfg: ModelConfig, params) -> Iterator[tuple[str, np.ndarray]]:
  """(Hugging Face name, tensor) for every tensor of a checkpoint: the inverse of `stacked_params`.

  `params` maps our names to stacked host arrays (a dict, or anything with __getitem__).
  """
  for name in param_names(cfg):
    if name in GLOBAL_PARAMS:
      yield hf_name(name), np.ascontiguousarray(to_hf(GLOBAL_PARAMS[name][1], params[name], cfg))
      continue
    stacked = params[name]  # fetched once: `params` may bring it from devices on each access
    for l in range(cfg.num_layers):
      yield hf_name(name, l), np.ascontiguousarray(to_hf(LAYER_PARAMS[name][1], stacked[l], cfg))


# ---------------------------------------------------------------------- config.json


def is_checkpoint_folder(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_config(folder: str) -> ModelConfig:
  """ModelConfig of a checkpoint folder (config.json through transformers' AutoConfig, offline)."""
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise PathError(f"{folder}: no config.json: expected a Hugging Face checkpoint folder with config.json and "
                    "*.safetensors")
  with open(path) as f:
    raw = json.load(f)
  archs = raw.get("architectures") or []
  supported = [a for a in archs if a in ARCHITECTURES]
  if not supported:
    raise UserError(f"{path}: unsupported architecture {'/'.join(archs) or '(none)'}: expected one of "
                    f"{', '.join(ARCHITECTURES)}")
  try:
    hf = import_transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
  except (OSError, ValueError, KeyError) as e:
    raise PathError(f"{path}: transformers cannot read it: {str(e).splitlines()[0]}") from None
  return config_from_hf(hf, ARCHITECTURES[supported[0]], path)


def import_transformers():
  """transformers, imported on first use (it is slow to import), without its notice that torch is absent."""
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  import transformers  # slow to import; only HF folders without tokenizer.json and config checks need it

  return transformers


def config_from_hf(hf, architecture: str, where: str) -> ModelConfig:
  """ModelConfig from a transformers config object (LlamaConfig, Qwen2Config, MistralConfig)."""
  if hf.hidden_act != "silu":
    raise UserError(f"{where}: hidden_act {hf.hidden_act!r} is not supported: expected 'silu'")
  if architecture == "llama" and (getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False)):
    raise UserError(f"{where}: attention_bias/mlp_bias on a Llama checkpoint are not supported: expected false")
  if getattr(hf, "use_sliding_window", False):
    raise UserError(f"{where}: use_sliding_window is not supported: expected false")
  theta, scaling = _rope(hf, where)
  heads = hf.num_attention_heads
  eos = hf.eos_token_id
  return ModelConfig(
      architecture=architecture, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
      num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=hf.num_key_value_heads or heads,
      head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, intermediate_size=hf.intermediate_size,
      rope_theta=theta, rope_scaling=scaling, rms_norm_eps=hf.rms_norm_eps,
      tie_word_embeddings=bool(hf.tie_word_embeddings), attention_bias=architecture == "qwen2",
      max_position_embeddings=hf.max_position_embeddings, bos_token_id=hf.bos_token_id,
      eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
      pad_token_id=hf.pad_token_id)


def _rope(hf, where: str) -> tuple[float, RopeScaling | None]:
  """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
  params = getattr(hf, "rope_parameters", None)
  if params is None:
    params = dict(getattr(hf, "rope_scaling", None) or {}, rope_theta=getattr(hf, "rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  theta = float(params.get("rope_theta", 10000.0))
  if kind == "default":
    return theta, None
  if kind != "llama3":
    raise UserError(f"{where}: rope type {kind!r} is not supported: expected default or llama3")
  return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                            high_freq_factor=float(params["high_freq_factor"]),
                            original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def config_json(cfg: ModelConfig, dtype: str = "float32") -> dict:
  """config.json of a checkpoint with `cfg`, in both the transformers 5 and 4.x rope spellings."""
  qwen = cfg.architecture == "qwen2"
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  legacy_scaling = None
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    legacy_scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                      "high_freq_factor": s.high_freq_factor,
                      "original_max_position_embeddings": s.original_max_position_embeddings}
    rope = dict(legacy_scaling, rope_theta=cfg.rope_theta)
  eos = list(cfg.eos_token_ids)
  out = {
      "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
      "model_type": "qwen2" if qwen else "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "rope_parameters": rope, "rope_theta": cfg.rope_theta, "rope_scaling": legacy_scaling,
      "tie_word_embeddings": cfg.tie_word_embeddings, "attention_dropout": 0.0, "initializer_range": 0.02,
      "use_cache": True, "bos_token_id": cfg.bos_token_id,
      "eos_token_id": eos[0] if len(eos) == 1 else (eos or None), "pad_token_id": cfg.pad_token_id,
      "dtype": dtype, "torch_dtype": dtype,
  }
  if qwen:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
  else:
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  return out


# ---------------------------------------------------------------------- safetensors


@contextlib.contextmanager
def open_safetensors(folder: str) -> Iterator[Reader]:
  """A reader `name -> np.ndarray` over a folder's single or sharded *.safetensors (memory-mapped)."""
  import safetensors  # only HF checkpoints need it

  index = os.path.join(folder, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
  if not files:
    raise PathError(f"{folder}: no *.safetensors weights: expected model.safetensors or "
                    "model.safetensors.index.json with its shards")
  with contextlib.ExitStack() as stack:
    handles = {}
    for f in files:
      path = os.path.join(folder, f)
      if not os.path.isfile(path):
        raise PathError(f"{path}: missing shard named in model.safetensors.index.json")
      handles[f] = stack.enter_context(safetensors.safe_open(path, framework="numpy"))
    where = {k: f for f, h in handles.items() for k in h.keys()}

    def read(name: str) -> np.ndarray:
      if name not in where:
        raise PathError(f"{folder}: tensor {name} is missing from the *.safetensors files")
      return handles[where[name]].get_tensor(name)

    yield read

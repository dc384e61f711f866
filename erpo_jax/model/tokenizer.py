"""Tokenizer: a `tokenizers` BPE model, special ids and a Jinja chat template rendered as transformers does."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from erpo_jax.errors import ConfigError, PathError

# End-of-turn tokens that stop generation besides the declared eos token,
# when the vocabulary has them as special tokens.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # GGUF tokenizer.ggml.token_type values


class Tokenizer:
  """Text <-> ids, with the ids that end a response and the chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None, eos_ids: Sequence[int],
               bos_id: int | None, pad_id: int | None = None, unk_id: int | None = None):
    if not eos_ids:
      raise ValueError("a tokenizer needs at least one eos id")
    self.backend = backend
    self.chat_template = chat_template
    self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
    self.bos_id = None if bos_id is None else int(bos_id)
    self.pad_id = self.eos_ids[0] if pad_id is None else int(pad_id)
    self.unk_id = None if unk_id is None else int(unk_id)
    self._template = None  # compiled on first use
    self._fingerprint = None

  def __getstate__(self):  # picklable for data-loader worker processes: the compiled template is not
    return dict(self.__dict__, _template=None)

  # ------------------------------------------------------------------ text

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, no special tokens added (special tokens written in the text are recognised)."""
    return self.backend.encode(text, add_special_tokens=False).ids

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode(text)` and, per token, the (start, end) character span of `text` it covers."""
    enc = self.backend.encode(text, add_special_tokens=False)
    return enc.ids, [tuple(o) for o in enc.offsets]

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, special tokens skipped."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

  def token(self, i: int | None) -> str | None:
    return None if i is None else self.backend.id_to_token(i)

  def special_tokens(self) -> dict[str, str]:
    """The template variables transformers passes: bos_token, eos_token, pad_token, unk_token."""
    names = {"bos_token": self.bos_id, "eos_token": self.eos_ids[0], "pad_token": self.pad_id,
             "unk_token": self.unk_id}
    return {k: self.token(i) for k, i in names.items() if i is not None}

  def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template applied to `messages`, as transformers' apply_chat_template(tokenize=False)."""
    if self.chat_template is None:
      raise ConfigError("data.chat_template: the tokenizer has no chat template: expected false, or a chat model")
    if self._template is None:
      self._template = compile_chat_template(self.chat_template)
    return self._template.render(messages=messages, tools=None, documents=None,
                                 add_generation_prompt=add_generation_prompt, **self.special_tokens())

  # ------------------------------------------------------------------ identity and files

  def fingerprint(self) -> str:
    """sha256 of what decides the ids and the prompt text: vocab, merges, pre-tokenizer, template, specials."""
    if self._fingerprint is None:
      self._fingerprint = self._hash()
    return self._fingerprint

  def _hash(self) -> str:
    spec = json.loads(self.backend.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    doc = {"model": spec["model"].get("type"), "vocab": vocab, "merges": merges,
           "normalizer": spec.get("normalizer"), "pre_tokenizer": spec.get("pre_tokenizer"),
           "added": sorted((t["id"], t["content"], t["special"]) for t in spec.get("added_tokens", [])),
           "chat_template": self.chat_template, "eos": self.eos_ids, "bos": self.bos_id, "pad": self.pad_id}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

  def save(self, folder: str) -> None:
    """Writes tokenizer.json and tokenizer_config.json, loadable by transformers' AutoTokenizer."""
    os.makedirs(folder, exist_ok=True)
    self.backend.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30, **self.special_tokens()}
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)

  # ------------------------------------------------------------------ constructors

  @classmethod
  def from_bpe(cls, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int], *,
               chat_template: str | None, eos_id: int, bos_id: int | None, pad_id: int | None,
               unk_id: int | None = None) -> Tokenizer:
    """Byte-level BPE as llama.cpp's gpt2 vocab (GGUF): digits split one by one, then the GPT-2 regex."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = tokenizers.decoders.ByteLevel()
    added = [tokenizers.AddedToken(tokens[i], special=(t == _GGUF_CONTROL), normalized=False)
             for i, t in enumerate(token_types) if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)]
    backend.add_tokens([a for a in added if not a.special])
    backend.add_special_tokens([a for a in added if a.special])
    return cls(backend, chat_template=chat_template, eos_ids=end_ids(backend, [eos_id]),
               bos_id=bos_id, pad_id=pad_id, unk_id=unk_id)

  @classmethod
  def from_folder(cls, folder: str) -> Tokenizer:
    """A Hugging Face tokenizer folder: tokenizer.json + tokenizer_config.json (+ chat_template.jinja)."""
    config = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    path = os.path.join(folder, "tokenizer.json")
    template = _chat_template(folder, config)
    if os.path.isfile(path):
      backend = tokenizers.Tokenizer.from_file(path)
    else:
      backend, template = _from_transformers(folder, template)
    gen = _read_json(os.path.join(folder, "generation_config.json")) or {}
    model = _read_json(os.path.join(folder, "config.json")) or {}

    def token_id(key):
      tok = config.get(key)
      if isinstance(tok, dict):
        tok = tok.get("content")
      return None if tok is None else backend.token_to_id(tok)

    eos = [token_id("eos_token")] + _ids(gen.get("eos_token_id")) + _ids(model.get("eos_token_id"))
    eos = [i for i in eos if i is not None]
    if not eos:
      raise PathError(f"{folder}: no eos token in tokenizer_config.json, generation_config.json or config.json")
    bos = token_id("bos_token")
    if bos is None and isinstance(model.get("bos_token_id"), int):
      bos = model["bos_token_id"]
    return cls(backend, chat_template=template, eos_ids=end_ids(backend, eos), bos_id=bos,
               pad_id=token_id("pad_token"), unk_id=token_id("unk_token"))


def end_ids(backend: tokenizers.Tokenizer, eos: Sequence[int]) -> tuple[int, ...]:
  """The declared eos ids, then the special end-of-turn tokens the vocabulary has.

  E.g. SmolLM2 declares <|im_end|> and also ends documents with <|endoftext|>;
  Qwen2.5 base declares <|endoftext|> while its chat template ends turns with <|im_end|>.
  """
  special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
  extra = [backend.token_to_id(t) for t in END_OF_TURN if t in special]
  return tuple(dict.fromkeys([*eos, *extra]))


# ---------------------------------------------------------------------- chat template


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template in the environment transformers uses (sandboxed, trim/lstrip blocks)."""

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(source)


def _chat_template(folder: str, config: dict) -> str | None:
  path = os.path.join(folder, "chat_template.jinja")
  if os.path.isfile(path):
    with open(path) as f:
      return f.read()
  t = config.get("chat_template")
  if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
    t = {x["name"]: x["template"] for x in t}.get("default")
  return t


def _from_transformers(folder: str, template: str | None):
  """The fast tokenizer transformers builds (e.g. converted from a sentencepiece file)."""
  from erpo_jax.model.io.hf import import_transformers  # model.io imports this module: only on this path

  try:
    tok = import_transformers().AutoTokenizer.from_pretrained(folder, local_files_only=True)
  except (OSError, ValueError) as e:
    raise PathError(f"{folder}: no usable tokenizer (expected tokenizer.json and tokenizer_config.json): "
                    f"{str(e).splitlines()[0]}") from None
  return tok.backend_tokenizer, template or tok.chat_template


def _read_json(path: str) -> dict | None:
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def _ids(x) -> list[int]:
  if x is None:
    return []
  return [int(i) for i in x] if isinstance(x, list) else [int(x)]

"""Config files: YAML with file:line tracking, `a.b=value` overrides, typed coercion with clear errors."""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import reprlib
import types
import typing
from typing import Any, Literal

import yaml

from erpo_jax.config import Config
from erpo_jax.errors import ConfigError, PathError


class _Where:
  """Maps dotted keys to 'file:line' for error messages."""

  def __init__(self):
    self.lines: dict[str, str] = {}

  def of(self, key: str) -> str:
    while key:
      if key in self.lines:
        return self.lines[key]
      key = key.rpartition(".")[0]
    return ""


_YAML_NODE_BUDGET = 10_000  # nodes of a config after aliases are expanded; a config has a few hundred


class _StrictLoader(yaml.SafeLoader):
  """PyYAML's safe loader without explicit tags (`!!python/...`, `!!float abc`) or non-scalar mapping keys."""

  def compose_node(self, parent, index):
    event = self.peek_event()
    tag = getattr(event, "tag", None)
    if tag not in (None, "!") and not isinstance(event, yaml.AliasEvent):
      short = tag.replace("tag:yaml.org,2002:", "!!")
      raise yaml.MarkedYAMLError(problem=f"tags such as '{short}' are not allowed in a config",
                                 problem_mark=event.start_mark)
    return super().compose_node(parent, index)


def _check_node(node, source: str, lines: bool) -> None:
  """Rejects complex mapping keys, alias cycles and alias expansions past _YAML_NODE_BUDGET (bounded work)."""
  at = lambda n: f"{source}:{n.start_mark.line + 1}" if lines else source
  seen = 0
  stack = [(node, ())]
  while stack:
    n, path = stack.pop()
    seen += 1
    if seen > _YAML_NODE_BUDGET:
      raise ConfigError(f"{at(n)}: invalid YAML (aliases expand to more than "
                        f"{_YAML_NODE_BUDGET} values)")
    if id(n) in path:
      raise ConfigError(f"{at(n)}: invalid YAML (an alias refers to itself)")
    if isinstance(n, yaml.MappingNode):
      for k, v in n.value:
        if not isinstance(k, yaml.ScalarNode):
          raise ConfigError(f"{at(k)}: invalid YAML (a mapping key must be a plain "
                            f"value, not a list or mapping)")
        stack.append((v, path + (id(n),)))
    elif isinstance(n, yaml.SequenceNode):
      stack.extend((v, path + (id(n),)) for v in n.value)


def safe_yaml(text: str, source: str, lines: bool = True):
  """(node, value) of YAML `text` (one document), read with _StrictLoader and checked by _check_node.

  Errors are ConfigErrors naming `source` (and the line when `lines`).
  """
  loader = _StrictLoader(text)
  try:
    node = loader.get_single_node()
    if node is None:
      return None, None
    _check_node(node, source, lines)
    return node, loader.construct_document(node)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f"{source}:{mark.line + 1}" if mark and lines else source
    raise ConfigError(f"{at}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
  except (ValueError, TypeError, OverflowError) as e:  # a value the safe constructor cannot build
    raise ConfigError(f"{source}: invalid YAML ({e})") from None
  finally:
    loader.dispose()


def _yaml_with_lines(text: str, source: str, where: _Where) -> dict:
  node, value = safe_yaml(text, source)
  if node is None:
    return {}
  if not isinstance(node, yaml.MappingNode):
    raise ConfigError(f"{source}:{node.start_mark.line + 1}: expected a mapping of config sections")

  def walk(n, prefix):
    if isinstance(n, yaml.MappingNode):
      for k, v in n.value:
        key = f"{prefix}{k.value}"
        where.lines[key] = f"{source}:{k.start_mark.line + 1}"
        walk(v, key + ".")

  walk(node, "")
  return value or {}


def _all_keys(cls, prefix="") -> list[str]:
  keys = []
  for f in dataclasses.fields(cls):
    keys.append(prefix + f.name)
    t = _resolve(cls, f)
    if dataclasses.is_dataclass(t):
      keys += _all_keys(t, prefix + f.name + ".")
  return keys


_HINTS: dict[type, dict] = {}


def _resolve(cls, f):
  if cls not in _HINTS:
    _HINTS[cls] = typing.get_type_hints(cls)
  return _HINTS[cls][f.name]


def _type_name(t) -> str:
  origin = typing.get_origin(t)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(t))
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_type_name(a) for a in typing.get_args(t))
  if origin is tuple:
    args = typing.get_args(t)
    if len(args) == 2 and args[1] is Ellipsis:
      return f"a list of {_type_name(args[0])}"
    return f"a list [{', '.join(_type_name(a) for a in args)}]"
  return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          type(None): "null"}.get(t, getattr(t, "__name__", str(t)))


class _Mismatch(Exception):
  pass


def _coerce(t, v):
  origin = typing.get_origin(t)
  if origin is Literal:
    if v in typing.get_args(t):
      return v
    raise _Mismatch
  if origin in (typing.Union, types.UnionType):
    for a in typing.get_args(t):
      try:
        return _coerce(a, v)
      except _Mismatch:
        pass
    raise _Mismatch
  if origin is tuple:
    if not isinstance(v, (list, tuple)):
      raise _Mismatch
    args = typing.get_args(t)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_coerce(args[0], x) for x in v)
    if len(args) != len(v):
      raise _Mismatch
    return tuple(_coerce(a, x) for a, x in zip(args, v))
  if t is type(None):
    if v is None:
      return None
    raise _Mismatch
  if t is bool:
    if isinstance(v, bool):
      return v
    raise _Mismatch
  if t is int:
    if isinstance(v, int) and not isinstance(v, bool) and -2**63 <= v < 2**63:
      return v
    raise _Mismatch
  if t is float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      return float(v)
    if isinstance(v, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
      try:
        return float(v)
      except ValueError:
        raise _Mismatch from None
    raise _Mismatch
  if t is str:
    if isinstance(v, str):
      return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      return str(v)
    raise _Mismatch
  raise _Mismatch


def _short_repr(v) -> str:
  """repr of a config value, at most about 80 characters (a value may be a large nested list)."""
  r = reprlib.Repr()
  r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother, r.maxlong = 2, 4, 4, 60, 60, 40
  text = r.repr(v)
  return text if len(text) <= 80 else text[:77] + "..."


def _build(cls, raw: dict, prefix: str, where: _Where):
  if not isinstance(raw, dict):
    at = where.of(prefix.rstrip("."))
    raise ConfigError(f"{at + ': ' if at else ''}{prefix.rstrip('.')}: expected a mapping, got {_short_repr(raw)}")
  names = {f.name: f for f in dataclasses.fields(cls)}
  kwargs = {}
  for k, v in raw.items():
    key = f"{prefix}{k}"
    at = where.of(key)
    if k not in names:
      close = difflib.get_close_matches(key, _all_keys(Config), n=1, cutoff=0.6)
      hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(names)}"
      raise ConfigError(f"{at + ': ' if at else ''}unknown config key '{key}'{hint}")
    t = _resolve(cls, names[k])
    if dataclasses.is_dataclass(t):
      kwargs[k] = _build(t, v if v is not None else {}, key + ".", where)
      continue
    try:
      kwargs[k] = _coerce(t, v)
    except _Mismatch:
      expected = _type_name(t)
      if isinstance(v, int) and not isinstance(v, bool) and "an integer" in expected:
        expected += " in [-2**63, 2**63)"
      raise ConfigError(f"{at + ': ' if at else ''}{key}: expected {expected}, got {_short_repr(v)}") from None
  try:
    return cls(**kwargs)
  except ConfigError as e:
    key = str(e).split(":", 1)[0]
    at = where.of(key)
    if at:
      raise ConfigError(f"{at}: {e}") from None
    raise


def _set_dotted(d: dict, key: str, value) -> None:
  parts = key.split(".")
  for p in parts[:-1]:
    nxt = d.get(p)
    if not isinstance(nxt, dict):
      nxt = {}
      d[p] = nxt
    d = nxt
  d[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
  """'a.b=value' -> ('a.b', value parsed as YAML)."""
  if "=" not in text:
    raise ConfigError(f"override '{text}': expected key=value, e.g. erpo.weights=dynamic")
  key, _, value = text.partition("=")
  key = key.strip()
  if not key:
    raise ConfigError(f"override '{text}': expected key=value, e.g. erpo.weights=dynamic")
  if not value.strip():
    return key, ""
  try:
    _, parsed = safe_yaml(value, f"override '{text}'", lines=False)
  except ConfigError as e:
    if "invalid YAML (" in str(e) and "!" not in value and "&" not in value and "*" not in value:
      return key, value  # not YAML (e.g. a path with ': '): taken as the text it is
    raise
  return key, parsed


def resolve_config_path(path: str | pathlib.Path) -> pathlib.Path:
  """A config path, or a bare name ('tiny') looked up in the repository's configs/."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  candidates = [pathlib.Path(__file__).resolve().parent.parent / "configs" / f"{p.name}",
                pathlib.Path(__file__).resolve().parent.parent / "configs" / f"{p.name}.yaml"]
  for c in candidates:
    if not p.suffix or p.parent == pathlib.Path("."):
      if c.is_file():
        return c
  raise PathError(f"config file '{path}' not found: give a YAML file such as configs/default.yaml")


def load_config(path: str | pathlib.Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Reads a YAML config (sections of Config) and applies `key.sub=value` overrides.

  A YAML file may name `base: other.yaml` (relative to itself) to start from another file.
  """
  where = _Where()
  raw: dict = {}
  if path is not None:
    raw = _load_file(resolve_config_path(path), where, depth=0)
  for i, o in enumerate(overrides):
    key, value = parse_override(o)
    where.lines[key] = f"override #{i + 1} '{o}'"
    _set_dotted(raw, key, value)
  return _build(Config, raw, "", where)


def _load_file(p: pathlib.Path, where: _Where, depth: int) -> dict:
  if depth > 8:
    raise ConfigError(f"{p}: 'base' chain too deep (a cycle?)")
  try:
    text = p.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise PathError(f"config file '{p}' cannot be read: {e}") from None
  local = _Where()
  raw = _yaml_with_lines(text, str(p), local)
  base = raw.pop("base", None)
  if base is not None:
    if not isinstance(base, str):
      raise ConfigError(f"{local.of('base')}: base: expected a path to another YAML file, got {base!r}")
    bp = (p.parent / base) if not pathlib.Path(base).is_absolute() else pathlib.Path(base)
    merged = _load_file(bp, where, depth + 1)
    _merge(merged, raw)
    raw = merged
  where.lines.update(local.lines)
  return raw


def _merge(dst: dict, src: dict) -> None:
  for k, v in src.items():
    if isinstance(v, dict) and isinstance(dst.get(k), dict):
      _merge(dst[k], v)
    else:
      dst[k] = v


def dump_config(cfg: Config) -> str:
  return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
  """{'a': {'b': 1}} -> {'a.b': 1}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out

"""The package layout keeps its promises: small modules, no import cycle, every deferred import says why."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "erpo_jax"
MAX_MODULE_BYTES = 15 * 1024


def modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the package."""
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    out[".".join(parts)] = path
  return out


def module_level_imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """The package modules `name` imports when it is imported (not those imported inside functions)."""
  found = set()
  tree = ast.parse(path.read_text())
  package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
  for node in tree.body:
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name in known}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      if base in known:
        found.add(base)
      found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
  return found - {name}


def test_no_module_of_the_package_is_over_15_kb():
  big = {str(p.relative_to(PACKAGE)): p.stat().st_size for p in modules().values()
         if p.stat().st_size > MAX_MODULE_BYTES}
  assert big == {}


def test_the_module_level_imports_of_the_package_have_no_cycle():
  mods = modules()
  graph = {n: module_level_imports(n, p, set(mods)) for n, p in mods.items()}
  assert graph["erpo_jax.train.loop"] >= {"erpo_jax.train.step", "erpo_jax.rollout.sampler"}  # the reader works
  state: dict[str, int] = {}  # 1 on the current path, 2 done
  cycles = []

  def visit(n: str, path: list[str]) -> None:
    state[n] = 1
    for m in sorted(graph[n]):
      if state.get(m) == 1:
        cycles.append(path[path.index(m):] + [m])
      elif m not in state:
        visit(m, path + [m])
    state[n] = 2

  for n in sorted(graph):
    if n not in state:
      visit(n, [n])
  assert cycles == []


def test_every_import_inside_a_function_comes_with_a_reason():
  unexplained = []
  for name, path in modules().items():
    lines = path.read_text().splitlines()
    for fn in ast.walk(ast.parse("\n".join(lines))):
      if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
      if not imports:
        continue
      first = min(imports, key=lambda n: n.lineno)
      span = lines[first.lineno - 2:first.end_lineno]  # the line before and the statement itself
      if not any("#" in line for line in span):
        unexplained.append(f"{path.relative_to(PACKAGE)}:{first.lineno} in {fn.name}()")
  assert unexplained == []

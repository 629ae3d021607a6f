"""The layers of jax_ep/ stay visible (issue 19): checked on the source tree, no import needed.

- no import circle between modules of jax_ep/ (module-level imports; a function-level import
  is how a module reaches a higher layer on demand, e.g. Buffer.warmup);
- no Python file over 600 lines;
- no private name (``_x``) of one module imported or read by another;
- the runtime (the public API, ``backends/``, ``peers/``, ``system/``, ``moe/``) never
  imports the tools (``tools/`` and their documented re-exports ``env``, ``launch``),
  at module level or inside a function;
- nothing of jax_ep imports the test extension ``jax_ep._C_testing`` (tests' bindings);
- ``system/`` imports nothing of jax_ep outside itself but ``fp8`` (whose scale block is a
  fact of every layer; it imports nothing of jax_ep), ``backends/`` and ``peers/`` nothing
  of the public API (``buffer``, ``ops``) or the MoE helpers.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jax_ep"
MAX_LINES = 600
TOOLS = ("jax_ep.tools", "jax_ep.env", "jax_ep.launch")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
EXTENSION = "jax_ep._C"  # compiled, not a Python file
TESTING_EXTENSION = "jax_ep._C_testing"  # compiled: the bindings only tests use
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _import_time_nodes(node):
    """The nodes run when the module is imported: not function bodies, not TYPE_CHECKING."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"):
            continue
        yield child
        yield from _import_time_nodes(child)


def _imports(module: str, top_level_only: bool):
    """(imported jax_ep module, the name taken from it or None, line) of `module`."""
    tree = TREES[module]
    nodes = _import_time_nodes(tree) if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jax_ep"):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if not source.startswith("jax_ep"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES or sub in (EXTENSION, TESTING_EXTENSION):
                    yield sub, None, node.lineno  # a submodule
                else:
                    yield source, alias.name, node.lineno


def _graph():
    graph = {}
    for module in MODULES:
        graph[module] = {target for target, _, _ in _imports(module, True)
                         if target in MODULES and target != module}
    return graph


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_file_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_private_names_across_modules():
    found = []
    for module in MODULES:
        aliases = {}  # local name -> jax_ep module it binds
        for node in ast.walk(TREES[module]):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(module, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in MODULES or sub == EXTENSION:
                        aliases[alias.asname or alias.name] = sub
                    elif (source.startswith("jax_ep") and alias.name.startswith("_")
                          and alias.name != "*"):
                        found.append(f"{module}:{node.lineno} imports {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in MODULES:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(TREES[module]):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and f"{aliases[node.value.id]}.{node.attr}" not in MODULES):
                found.append(f"{module}:{node.lineno} reads "
                             f"{aliases[node.value.id]}.{node.attr}")
    assert found == []


def test_runtime_never_imports_the_tools():
    found = [f"{module}:{line} imports {target}"
             for module in MODULES if not _in(module, TOOLS)
             for target, _, line in _imports(module, False) if _in(target, TOOLS)]
    assert found == []


def test_the_package_never_imports_the_test_extension():
    found = [f"{module}:{line} imports {target}"
             for module in MODULES for target, _, line in _imports(module, False)
             if target == TESTING_EXTENSION]
    assert found == []


def test_the_checker_sees_an_import_of_the_test_extension():
    module = "jax_ep.buffer"
    planted = ast.parse("def f():\n    from jax_ep import _C_testing\n")
    saved = TREES[module]
    TREES[module] = planted
    try:
        assert [t for t, _, _ in _imports(module, False)] == [TESTING_EXTENSION]
    finally:
        TREES[module] = saved


def test_lower_layers_do_not_import_higher_ones():
    rules = {
        "jax_ep.system": lambda t: _in(t, ("jax_ep.system", "jax_ep.fp8")),
        "jax_ep.fp8": lambda t: False,
        "jax_ep.backends": lambda t: not _in(t, ("jax_ep.buffer", "jax_ep.ops", "jax_ep.moe",
                                                 "jax_ep.aot", "jax_ep.warmup")) and t != "jax_ep",
        "jax_ep.peers": lambda t: not _in(t, ("jax_ep.buffer", "jax_ep.ops", "jax_ep.moe",
                                                   "jax_ep.backends")) and t != "jax_ep",
    }
    found = []
    for module in MODULES:
        for layer, allowed in rules.items():
            if _in(module, (layer,)):
                found += [f"{module}:{line} imports {target}"
                          for target, _, line in _imports(module, False)
                          if target not in (EXTENSION, TESTING_EXTENSION) and not allowed(target)]
    assert found == []


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

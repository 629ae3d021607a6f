"""The layers of jax_ep/ stay visible: checked on the source tree, no import needed.

- no import circle between modules of jax_ep/, function-level imports included (one defers
  the circle to the call; a function-level import may reach a higher layer on demand, e.g.
  Buffer.warmup, but not close a circle); imports under ``TYPE_CHECKING`` never run and are
  left out;
- no Python file over 600 lines;
- no private name (``_x``) of one module imported or read by another;
- the runtime (the public API, ``backends/``, ``peers/``, ``system/``, ``moe/``) never
  imports the tools (``tools/`` and their documented re-exports ``env``, ``launch``),
  at module level or inside a function;
- nothing of jax_ep imports the test extension ``jax_ep._C_testing`` (tests' bindings);
- ``system/`` imports nothing of jax_ep outside itself but ``fp8`` (whose scale block is a
  fact of every layer; it imports nothing of jax_ep), ``backends/`` and ``peers/`` nothing
  of the public API (``buffer``, ``ops``) or the MoE helpers.

The scan must hold jax_ep's modules and every layer the rules name, and each checker must find
the violation of its rule planted in a small package of the same name (PLANTED): a checker
that finds nothing proves nothing.
"""

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jax_ep"
MAX_LINES = 600
TOOLS = ("jax_ep.tools", "jax_ep.env", "jax_ep.launch")
EXTENSION = "jax_ep._C"  # compiled, not a Python file
TESTING_EXTENSION = "jax_ep._C_testing"  # compiled: the bindings only tests use
EXTENSIONS = (EXTENSION, TESTING_EXTENSION)
# What each rule of test_lower_layers_do_not_import_higher_ones may import, by layer.
LAYER_RULES = {
    "jax_ep.system": lambda t: _in(t, ("jax_ep.system", "jax_ep.fp8", "jax_ep.settings")),
    "jax_ep.fp8": lambda t: False,
    "jax_ep.settings": lambda t: False,  # the table of JAX_EP_* variables: a leaf
    "jax_ep.backends": lambda t: not _in(t, ("jax_ep.buffer", "jax_ep.ops", "jax_ep.moe",
                                             "jax_ep.aot", "jax_ep.warmup")) and t != "jax_ep",
    "jax_ep.peers": lambda t: not _in(t, ("jax_ep.buffer", "jax_ep.ops", "jax_ep.moe",
                                               "jax_ep.backends")) and t != "jax_ep",
}


class Package(NamedTuple):
    """The Python modules of one package folder: dotted name -> file, and -> parsed tree."""

    modules: dict
    trees: dict


def scan(root: Path) -> Package:
    def name(path):
        parts = path.relative_to(root.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in sorted(root.rglob("*.py"))}
    return Package(modules, {m: ast.parse(p.read_text(), str(p)) for m, p in modules.items()})


JAX_EP = scan(PACKAGE)


def _resolve(pkg: Package, module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = pkg.modules[module].name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _run_nodes(node):
    """The nodes that may run, at import or in a call: all but the TYPE_CHECKING blocks."""
    for child in ast.iter_child_nodes(node):
        if (isinstance(child, ast.If) and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"):
            continue
        yield child
        yield from _run_nodes(child)


def _imports(pkg: Package, module: str, run_only: bool):
    """(imported jax_ep module, the name taken from it or None, line) of `module`: with
    `run_only` the imports that run (at module level or in a function), else all of them."""
    tree = pkg.trees[module]
    nodes = _run_nodes(tree) if run_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jax_ep"):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(pkg, module, node)
            if not source.startswith("jax_ep"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in pkg.modules or sub in EXTENSIONS:
                    yield sub, None, node.lineno  # a submodule
                else:
                    yield source, alias.name, node.lineno


def _graph(pkg: Package):
    graph = {}
    for module in pkg.modules:
        graph[module] = {target for target, _, _ in _imports(pkg, module, True)
                         if target in pkg.modules and target != module}
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


# ---------------------------------------------------------------------------- the checkers
def import_cycles(pkg: Package):
    return _cycles(_graph(pkg))


def long_files(pkg: Package):
    return {module: n for module, p in pkg.modules.items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}


def private_names_across_modules(pkg: Package):
    found = []
    for module in pkg.modules:
        aliases = {}  # local name -> jax_ep module it binds
        for node in ast.walk(pkg.trees[module]):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(pkg, module, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in pkg.modules or sub in EXTENSIONS:
                        aliases[alias.asname or alias.name] = sub
                    elif (source.startswith("jax_ep") and alias.name.startswith("_")
                          and alias.name != "*"):
                        found.append(f"{module}:{node.lineno} imports {source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in pkg.modules:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(pkg.trees[module]):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and f"{aliases[node.value.id]}.{node.attr}" not in pkg.modules):
                found.append(f"{module}:{node.lineno} reads "
                             f"{aliases[node.value.id]}.{node.attr}")
    return found


def runtime_imports_of_the_tools(pkg: Package):
    return [f"{module}:{line} imports {target}"
            for module in pkg.modules if not _in(module, TOOLS)
            for target, _, line in _imports(pkg, module, False) if _in(target, TOOLS)]


def imports_of_higher_layers(pkg: Package):
    found = []
    for module in pkg.modules:
        for layer, allowed in LAYER_RULES.items():
            if _in(module, (layer,)):
                found += [f"{module}:{line} imports {target}"
                          for target, _, line in _imports(pkg, module, False)
                          if target not in EXTENSIONS and not allowed(target)]
    return found


def imports_of_the_test_extension(pkg: Package):
    """Nothing of jax_ep imports the test module jax_ep._C_testing (tests' bindings)."""
    return [f"{module}:{line} imports {target}"
            for module in pkg.modules for target, _, line in _imports(pkg, module, False)
            if target == TESTING_EXTENSION]


# ---------------------------------------------------------------------------- jax_ep/
def test_the_scan_sees_every_layer():
    """The checks below pass on an empty scan: it must hold jax_ep's modules, and each layer
    the rules name must have modules (a renamed folder would leave its rule checking nothing)."""
    assert len(JAX_EP.modules) > 20, sorted(JAX_EP.modules)
    assert {"jax_ep", "jax_ep.buffer", "jax_ep.ops", "jax_ep.backends.cuda"} <= set(JAX_EP.modules)
    for layer in (*LAYER_RULES, *TOOLS):
        assert any(_in(m, (layer,)) for m in JAX_EP.modules), layer
    assert JAX_EP.trees.keys() == JAX_EP.modules.keys()


def test_no_import_cycles():
    assert import_cycles(JAX_EP) == []


def test_no_file_over_600_lines():
    assert long_files(JAX_EP) == {}


def test_no_private_names_across_modules():
    assert private_names_across_modules(JAX_EP) == []


def test_runtime_never_imports_the_tools():
    assert runtime_imports_of_the_tools(JAX_EP) == []


def test_lower_layers_do_not_import_higher_ones():
    assert imports_of_higher_layers(JAX_EP) == []


def test_the_package_never_imports_the_test_extension():
    assert imports_of_the_test_extension(JAX_EP) == []


# ---------------------------------------------------------------------------- planted violations
PLANTED = {
    "__init__.py": "from jax_ep import buffer\n",
    "buffer.py": "from jax_ep import ops\n_secret = 1\n",
    # a cycle (ops -> buffer -> ops), a private name imported and one read
    "ops.py": "import jax_ep.buffer as buf\nfrom jax_ep.buffer import _secret\nbuf._hidden\n",
    "fp8.py": "\n" * (MAX_LINES + 1),  # one line too many
    "tools/__init__.py": "",
    "tools/demo.py": "from jax_ep import backends\n",  # the tools may import the runtime
    "backends/__init__.py": "",
    # the runtime imports a tool inside a function, and a higher layer at module level
    "backends/cuda.py": "from jax_ep import ops\n\n\ndef f():\n    from jax_ep.tools import demo\n",
    "warmup.py": "def f():\n    from jax_ep import _C_testing\n",  # tests' bindings
    # a circle closed by a function-level import (none through a TYPE_CHECKING one)
    "moe/__init__.py": "",
    "moe/layer.py": "def f():\n    from jax_ep.moe import stages\n",
    "moe/stages.py": "from typing import TYPE_CHECKING\n\nfrom jax_ep.moe.layer import f\n\n"
                     "if TYPE_CHECKING:\n    from jax_ep import aot\n",
    "aot.py": "from jax_ep.moe import stages\n",
    "system/__init__.py": "",
    # fp8 and its own layer are allowed; the public API is not
    "system/probes.py": "import jax\nfrom jax_ep import fp8\nfrom jax_ep.system import probes\n"
                        "from jax_ep import buffer\n",
}


@pytest.fixture
def planted(tmp_path):
    """A jax_ep of a few files, each rule broken once (PLANTED)."""
    for name, text in PLANTED.items():
        path = tmp_path / "jax_ep" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan(tmp_path / "jax_ep")


def test_the_checker_sees_a_cycle(planted):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles(planted) == [["jax_ep.buffer", "jax_ep.ops"],
                                      ["jax_ep.moe.layer", "jax_ep.moe.stages"]]


def test_the_checker_sees_a_long_file(planted):
    assert long_files(planted) == {"jax_ep.fp8": MAX_LINES + 1}


def test_the_checker_sees_private_names_across_modules(planted):
    assert private_names_across_modules(planted) == [
        "jax_ep.ops:2 imports jax_ep.buffer._secret", "jax_ep.ops:3 reads jax_ep.buffer._hidden"]


def test_the_checker_sees_the_runtime_import_a_tool(planted):
    assert runtime_imports_of_the_tools(planted) == [
        "jax_ep.backends.cuda:5 imports jax_ep.tools.demo"]


def test_the_checker_sees_a_lower_layer_import_a_higher_one(planted):
    assert imports_of_higher_layers(planted) == ["jax_ep.backends.cuda:1 imports jax_ep.ops",
                                                 "jax_ep.system.probes:4 imports jax_ep.buffer"]


def test_the_checker_sees_an_import_of_the_test_extension(planted):
    assert imports_of_the_test_extension(planted) == ["jax_ep.warmup:2 imports jax_ep._C_testing"]

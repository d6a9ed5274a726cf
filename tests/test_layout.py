"""The house rules, checked on the real tree by reading the sources: imports only run down the
floors, no private name crosses a module boundary, no import cycle, and the kernels (Pallas, CPU)
are leaves that import only JAX, NumPy, each other and the standard library; and every module
imports on its own."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("relf_jax", "kernels_pallas", "kernels_cpu", "experiments")
KERNEL_PACKAGES = ("kernels_pallas", "kernels_cpu")

# (importer prefix, forbidden import prefixes): a floor never imports a floor above it
FLOORS = [
    # models are networks only: the flow math, the samplers and the methods sit above them
    ("relf_jax.models", ("relf_jax.export", "relf_jax.serving", "relf_jax.flow", "relf_jax.speculative",
                         "relf_jax.sampling", "relf_jax.dws", "relf_jax.eval", "experiments")),
    ("relf_jax.flow", ("relf_jax.serving", "experiments")),
    ("relf_jax.speculative", ("relf_jax.serving", "experiments")),
    ("relf_jax.sampling", ("relf_jax.serving", "experiments")),
    ("relf_jax", ("experiments",)),
]
KERNEL_IMPORTS = ("jax", "jaxlib", "numpy", *KERNEL_PACKAGES)


class Module:
    def __init__(self, name: str, path: pathlib.Path):
        self.name, self.path = name, path
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _modules(roots) -> dict[str, Module]:
    out = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = Module(".".join(parts), path)
    return out


MODULES = _modules(PACKAGES)
TESTS = _modules(["tests"])
KNOWN = {**MODULES, **TESTS}


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(nodes, top_level_only):
    """The import statements among `nodes`, skipping `if TYPE_CHECKING:` blocks; with
    top_level_only, those run when the module is imported (not inside a def or class body)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking(node):
            continue
        elif not (top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            yield from _import_nodes(ast.iter_child_nodes(node), top_level_only)


_IMPORTS = {}


def _imports(mod: Module, top_level_only: bool = False) -> list:
    """(line, imported module, name or None) for each import; `from a import b` gives (a.b, None)
    when a.b is a known module, else (a, b)."""
    key = (mod.name, mod.path, top_level_only)
    if key not in _IMPORTS:
        out = []
        for node in _import_nodes(mod.tree.body, top_level_only):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name, None) for a in node.names]
            else:
                base = _absolute(mod, node)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out.append((node.lineno, full, None) if full in KNOWN else (node.lineno, base, a.name))
        _IMPORTS[key] = out
    return _IMPORTS[key]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_crossings(modules: dict[str, Module]) -> list[str]:
    """`from x import _y` and `m._y` on an imported module m, for first-party x and m. A private
    module (`_impl.py`) may be imported inside its own package."""
    bad = []
    for mod in modules.values():
        aliases = {}  # local name -> first-party module it is bound to
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in KNOWN or a.name.split(".")[0] in PACKAGES:
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node)
                if base.split(".")[0] not in (*PACKAGES, "tests"):
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in KNOWN:
                        aliases[a.asname or a.name] = full
                    if _private(a.name) and not (full in KNOWN and mod.name.startswith(base + ".")):
                        bad.append(f"{mod.path.relative_to(ROOT)}:{node.lineno}: from {base} import {a.name}")
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    owner = ".".join([aliases[value.id], *reversed(chain[1:])])
                    if owner != mod.name and owner in KNOWN:
                        bad.append(f"{mod.path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.attr}")
    return sorted(set(bad))


def _floor_violations() -> list[str]:
    bad = []
    for mod in MODULES.values():
        rule = next(((p, f) for p, f in FLOORS if mod.name == p or mod.name.startswith(p + ".")), None)
        if rule is None:
            continue
        for line, target, _ in _imports(mod):
            if any(target == f or target.startswith(f + ".") for f in rule[1]):
                bad.append(f"{mod.path.relative_to(ROOT)}:{line}: {rule[0]} imports {target}")
    return bad


def _kernel_imports() -> list[str]:
    bad = []
    for mod in MODULES.values():
        if mod.name.split(".")[0] not in KERNEL_PACKAGES:
            continue
        for line, target, _ in _imports(mod):
            top = target.split(".")[0]
            if top not in KERNEL_IMPORTS and top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{mod.path.relative_to(ROOT)}:{line}: imports {target}")
    return bad


def _import_graph(top_level_only: bool) -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (a package's __init__ is its own
    node; importing a.b does not count as importing a)."""
    graph = {name: set() for name in MODULES}
    for mod in MODULES.values():
        for _, target, _ in _imports(mod, top_level_only):
            while target and target not in MODULES:  # `import a.b.c` of a non-module name: its owner
                target = target.rpartition(".")[0]
            if target and target != mod.name:
                graph[mod.name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checks_see_the_tree():
    assert {"relf_jax", "relf_jax.models", "kernels_pallas", "experiments.launch"} <= set(MODULES)
    assert any(line for line, *_ in _imports(MODULES["relf_jax.models"]))


def test_imports_run_down_the_floors():
    bad = _floor_violations()
    assert bad == [], "\n".join(bad)


def test_kernels_import_only_jax_numpy_and_the_standard_library():
    bad = _kernel_imports()
    assert bad == [], "\n".join(bad)


def test_no_import_cycle_at_module_level():
    cycles = _cycles(_import_graph(top_level_only=True))
    assert cycles == [], cycles


def test_no_import_cycle_even_through_function_level_imports():
    cycles = _cycles(_import_graph(top_level_only=False))
    assert cycles == [], cycles


def test_no_private_name_crosses_a_module_boundary_in_the_library():
    bad = _private_crossings(MODULES)
    assert bad == [], "\n".join(bad)


def test_no_private_name_crosses_a_module_boundary_in_the_tests():
    bad = _private_crossings(TESTS)
    assert bad == [], "\n".join(bad)


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted((n for n in MODULES if n.split(".")[0] == "relf_jax"), reverse=True)  # the deepest first
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_private_name_check_finds_what_it_should(tmp_path):
    """The checker itself: `from x import _y` and `m._y` are caught; `self._y`, dunders and a
    module's own private names are not."""
    src = ("import relf_jax.config as c\nfrom relf_jax import config\n"
           "from relf_jax.config import _hidden, make_config\n"
           "x = c._a + config._b + config.__doc__\n"
           "class K:\n    def f(self):\n        return self._c\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    mod = Module("tests.probe", path)
    mod.path = ROOT / "tests" / "probe.py"
    found = _private_crossings({"tests.probe": mod})
    assert [f.split(": ", 1)[1] for f in found] == [
        "from relf_jax.config import _hidden", "relf_jax.config._a", "relf_jax.config._b"], found


def test_the_cycle_check_finds_what_it_should():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "d"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert sum(map(len, _import_graph(top_level_only=False).values())) > 100  # it sees the real imports

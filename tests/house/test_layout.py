"""The package's shape: layers depend one way, files stay small, switches are read in one place.

Checked by reading the source (ast), so a violation fails here before anyone reviews it:
  * no import cycle among tailored's modules (imports inside functions count: they are the
    usual way to hide a cycle; `if TYPE_CHECKING:` imports do not, they never run);
  * the layers' directions: engine/ never imports server/ or worker/, model/ never imports
    worker/, kernels/ and ops/ import neither model/ nor worker/ nor engine/;
  * no module imports another module's private (`_name`) names;
  * no file over 600 lines;
  * no `TAILORED_*` environment read outside tailored/flags.py.
The same rules hold for sammie/ (the segmentation server, docs/sammie.md), whose switches are
`SAMMIE_*` in sammie/flags.py; sammie may use tailored's public names, tailored never imports
sammie.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "tailored"
PKGS = (PKG, PKG.parent / "sammie")
ROOTS = tuple(p.name for p in PKGS)
MAX_LINES = 600


def _sources():
    return [p for pkg in PKGS for p in sorted(pkg.rglob("*.py"))]


def _modules() -> dict[str, Path]:
    out = {}
    for p in _sources():
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: dict) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) of every import in `path` outside
    `if TYPE_CHECKING:` blocks, resolved to tailored / sammie modules."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(ROOTS):
                    found.append((a.name, []))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith(ROOTS):
            names = [a.name for a in node.names]
            subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in modules]
            found.append((node.module, [n for n in names if f"{node.module}.{n}" not in modules]))
            found += [(s, []) for s in subs]
    return [(m, n) for m, n in found if m in modules]


def _graph():
    modules = _modules()
    return modules, {m: _imports(p, modules) for m, p in modules.items()}


@pytest.mark.contract("house-rules")
def test_no_import_cycle():
    modules, g = _graph()
    edges = {m: {t for t, _ in deps if t != m and not m.startswith(t + ".")} for m, deps in g.items()}
    # a package's __init__ importing its own submodule is not a cycle of layers
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


LAYER_RULES = {  # a module under the key may not import modules under any of the values
    "tailored.engine": ("tailored.server", "tailored.worker", "tailored.model",
                        "tailored.kernels", "tailored.stack"),
    "tailored.model": ("tailored.worker", "tailored.engine", "tailored.server", "tailored.stack"),
    "tailored.kernels": ("tailored.model", "tailored.worker", "tailored.engine",
                         "tailored.server"),
    "tailored.ops": ("tailored.model", "tailored.worker", "tailored.engine", "tailored.server",
                     "tailored.kernels"),
    "tailored.worker": ("tailored.server", "tailored.stack"),
    "tailored": ("sammie",),
    "sammie.model": ("sammie.engine", "sammie.server", "sammie.gate", "sammie.bench"),
}


@pytest.mark.contract("house-rules")
def test_layers_depend_one_way():
    _, g = _graph()
    bad = []
    for m, deps in g.items():
        for layer, banned in LAYER_RULES.items():
            if m == layer or m.startswith(layer + "."):
                bad += [f"{m} imports {t}" for t, _ in deps
                        if any(t == b or t.startswith(b + ".") for b in banned)]
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_names():
    _, g = _graph()
    bad = [f"{m} imports {n} from {t}" for m, deps in g.items() for t, names in deps
           for n in names if n.startswith("_") and t != m]
    assert not bad, "\n".join(bad)


@pytest.mark.contract("house-rules")
def test_no_file_over_600_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


@pytest.mark.contract("house-rules")
def test_switches_are_read_in_flags_only():
    """`TAILORED_` (`SAMMIE_`) may appear in strings and comments elsewhere (messages, docs),
    but only tailored/flags.py (sammie/flags.py) reads the environment for it."""
    bad = []
    for pkg, prefix in ((PKG, "TAILORED"), (PKGS[1], "SAMMIE")):
        for p in pkg.rglob("*.py"):
            if p.name == "flags.py" and p.parent == pkg:
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Call):
                    f = ast.unparse(node.func)
                    if f in ("os.environ.get", "os.getenv", "environ.get", "getenv") \
                            and node.args and prefix in ast.unparse(node.args[0]):
                        bad.append(f"{p.relative_to(PKG.parent)}:{node.lineno}")
                elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in (
                        "os.environ", "environ") and prefix in ast.unparse(node.slice):
                    bad.append(f"{p.relative_to(PKG.parent)}:{node.lineno}")
    assert not bad, bad

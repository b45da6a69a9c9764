"""The package's architecture, checked: no import cycles inside `jaxamp/`, no module importing another's private
name, the application (`jaxamp.lm`) reaching the library only through public names, and `__all__` where it is
promised. Read from the source (ast), so a cycle hidden behind `if TYPE_CHECKING:` or a function-level import counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "jaxamp"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path):
    """`(module imported, names imported from it, line)` for every import in `path`, wherever it stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, tuple(a.name for a in node.names), node.lineno


def _internal_edges() -> dict[str, set[str]]:
    """Module -> the jaxamp modules it imports (`from jaxamp import x` counts as importing `jaxamp.x` when `x` is a
    module, else `jaxamp`)."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(path):
            if not module.startswith("jaxamp"):
                continue
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES] or [module]
            edges[name].update(t for t in targets if t in MODULES and t != name)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles():
    edges = _internal_edges()
    # The package's own __init__ imports its modules; a module importing `jaxamp` (the package) would close a cycle
    # through it, so that edge counts too.
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        for module, names, line in _imports(path):
            if module.startswith("jaxamp") and module != name:
                bad += [f"{path.relative_to(PKG.parent)}:{line} imports {module}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {a.asname or a.name.split(".")[-1]: f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom)
                   else a.name
                   for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for a in node.names if (getattr(node, "module", None) or a.name).startswith("jaxamp")}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] in MODULES and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_the_application_uses_the_library_through_public_names_only():
    """`jaxamp.lm` imports from the library only names the library module exports (its `__all__`, where it has one)."""
    exported = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                exported[name] = set(ast.literal_eval(node.value))
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("jaxamp.lm"):
            continue
        for module, names, line in _imports(path):
            if module in MODULES and not module.startswith("jaxamp.lm") and module in exported:
                bad += [f"{name}:{line} {module}.{n}" for n in names if n not in exported[module]
                        and f"{module}.{n}" not in MODULES]
    assert not bad, "the application imports library names that are not exported:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["jaxamp", "jaxamp.nnx", "jaxamp.layers", "jaxamp.attention", "jaxamp.finite",
                                    "jaxamp.fp8_collection", "jaxamp.gradients", "jaxamp.metrics",
                                    "jaxamp.trainable"])
def test_public_modules_declare_all(module):
    mod = __import__(module, fromlist=["_"])
    assert mod.__all__, module
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it lacks: {missing}"

"""The code's shape rules: lower layers never import higher ones, daemon/'s imports form no cycle, and
no module reaches into another object's private members (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["dilocox", "peers", "daemon"]  # each may import only the ones before it (and proto)
LOCAL = set(LAYERS) | {"proto"}
ALLOWED = {("os", "_exit")}  # public despite the underscore: the documented exit without cleanup


def _modules(package: str) -> dict[str, ast.Module]:
    """Every module of a layer folder, subpackages included, by dotted name (dilocox.sparse.wire; a package's
    __init__.py by the package's name)."""
    found = {}
    for p in sorted((REPO / package).rglob("*.py")):
        parts = p.relative_to(REPO / package).with_suffix("").parts
        name = ".".join((package,) + (parts[:-1] if parts[-1] == "__init__" else parts))
        found[name] = ast.parse(p.read_text(), str(p))
    return found


def _local(name: str) -> str:
    """An import's name in repository terms: dilocox.daemon.x -> daemon.x (the folders are mapped into one
    namespace, pyproject.toml), dilocox.x -> dilocox.x."""
    for sub in ("daemon", "peers", "proto"):
        if name == f"dilocox.{sub}" or name.startswith(f"dilocox.{sub}."):
            return name[len("dilocox."):]
    return name


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # "from dilocox.daemon import x"
    return {_local(name) for name in found if name.split(".")[0] in LOCAL}


def test_installed_names_are_ours_alone():
    """Nothing imports the repository's folders by their bare names (daemon, peers, proto): installed, they
    live under dilocox (so python-daemon's `daemon` or proto-plus's `proto` are never shadowed)."""
    bare = []
    for package in LAYERS + ["bench", "tests"]:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                bare += [f"{path.relative_to(REPO)}: {n}" for n in names
                         if n.split(".")[0] in ("daemon", "peers", "proto")]
    assert not bare, bare


def test_lower_layers_never_import_higher_ones():
    wrong = []
    for rank, package in enumerate(LAYERS):
        for module, tree in _modules(package).items():
            if module == "dilocox.__main__":  # `python -m dilocox` is the node's entry point, not the algorithm
                continue
            wrong += [(module, name) for name in _imports(tree) if name.split(".")[0] in LAYERS[rank + 1:]]
    assert not wrong, wrong


def test_nothing_outside_experimental_imports_it():
    """dilocox/experimental/ holds what only the benchmarks run: the product (daemon/, peers/ and the rest of
    dilocox/) never imports it."""
    wrong = []
    for package in LAYERS:
        for module, tree in _modules(package).items():
            if module == "dilocox.experimental" or module.startswith("dilocox.experimental."):
                continue
            wrong += [(module, name) for name in _imports(tree)
                      if name == "dilocox.experimental" or name.startswith("dilocox.experimental.")]
    assert not wrong, wrong


def test_daemon_import_graph_has_no_cycle():
    modules = _modules("daemon")
    graph = {m: {i for i in _imports(t) if i in modules} for m, t in modules.items()}
    visiting, done = set(), set()

    def visit(m, path):
        assert m not in visiting, f"import cycle: {' -> '.join(path + [m])}"
        if m in done:
            return
        visiting.add(m)
        for n in sorted(graph[m]):
            visit(n, path + [m])
        visiting.discard(m)
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_no_access_to_other_objects_private_members():
    """``x._name`` is allowed only on self / cls (and dunders); everything else goes through public methods."""
    wrong = []
    for package in LAYERS:
        for module, tree in _modules(package).items():
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                        and (getattr(node.value, "id", None), node.attr) not in ALLOWED):
                    wrong.append(f"{module}:{node.lineno} .{node.attr}")
    assert not wrong, wrong

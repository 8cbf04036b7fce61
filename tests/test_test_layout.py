"""The tests' own layout: no module under tests/ imports a test module (tests/**/test_*.py). Importing one couples
the files and re-runs its collection side effects (its module-level code, the fixtures it brings along); what
tests share lives in modules that are not test modules (tests/fakes/, tests/corpus.py, tests/helpers.py,
tests/harness/, ...) and shared fixtures in tests/fixtures.py, the plugin tests/conftest.py registers."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _is_test_module(dotted: str) -> bool:
    """``tests.test_x`` or ``tests.sub.test_x`` (or a name inside one)."""
    parts = dotted.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") for p in parts[1:])


def imports_of_test_modules(path: Path, root: Path = ROOT) -> list[str]:
    """Each import in ``path`` (a file under ``root``) of a test module, as ``file:line: statement``: ``import
    tests.test_x``, ``from tests.test_x import y``, ``from tests import test_x`` and their relative forms, at
    module level or inside a function."""
    package = list(path.relative_to(root).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        if any(_is_test_module(n) for n in names):
            found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}"))
    return [line for _, line in sorted(found)]


def test_no_module_under_tests_imports_a_test_module():
    offenders = [o for p in sorted(TESTS.rglob("*.py")) for o in imports_of_test_modules(p)]
    assert not offenders, ("these import a test module; move what they share to a module under tests/ that is not "
                           "test_*.py (tests/fakes/, ...) and shared fixtures to tests/fixtures.py:\n"
                           + "\n".join(offenders))


def test_the_rule_sees_every_form_of_import(tmp_path):
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    sample = tmp_path / "tests" / "sub" / "sample.py"
    sample.write_text("import tests.test_a\n"
                      "from tests.test_b import x\n"
                      "from tests import test_c, helpers\n"
                      "def f():\n"
                      "    import tests.sub.test_d as d\n"
                      "from . import test_e\n"
                      "from ..test_f import y\n"
                      "import tests.helpers\n"
                      "from tests.fakes import progress\n"
                      "from . import fakes\n"
                      "from ..harness.localswarm import LocalNode\n"
                      "import test_g\n")  # not the tests package: some other project's module
    found = [o.split(": ", 1)[1] for o in imports_of_test_modules(sample, tmp_path)]
    assert found == ["import tests.test_a", "from tests.test_b import x", "from tests import test_c, helpers",
                     "import tests.sub.test_d as d", "from . import test_e", "from ..test_f import y"]

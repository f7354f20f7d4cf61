"""Test modules stand alone: none imports another test module or conftest.py. Shared helpers live
in modules without the test_ prefix (tests/train_runs.py, tests/tool_files.py, ...); fixtures
shared by every file live in conftest.py, which pytest loads and nothing imports."""

from __future__ import annotations

import ast
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _is_test_module_or_conftest(dotted: str) -> bool:
    last = dotted.split(".")[-1]
    return last.startswith("test_") or last == "conftest"


def _imported(path: str) -> list[tuple[int, str]]:
    """(line, module) of every module `path` imports, `from tests import x` counted as tests.x and
    relative imports resolved against the tests package."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(filter(None, ["tests", base]))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if base in ("tests", "")]
    return found


def _sources() -> list[str]:
    return sorted(
        os.path.join(dirpath, f) for dirpath, _, files in os.walk(HERE) for f in files if f.endswith(".py")
    )


def test_no_test_module_imports_another_test_module_or_conftest():
    sources = _sources()
    assert sum(os.path.basename(p).startswith("test_") for p in sources) > 50  # the scan sees the suite
    offenders = [
        f"{os.path.relpath(path, os.path.dirname(HERE))}:{line} imports {module}"
        for path in sources
        for line, module in _imported(path)
        if _is_test_module_or_conftest(module)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_scan_sees_every_spelling_of_such_an_import(tmp_path):
    """The spellings the scan must catch, and the helper imports it must let through."""
    caught = {
        "from tests.test_identify import _face": "tests.test_identify",
        "import tests.conftest": "tests.conftest",
        "from tests import conftest": "tests.conftest",
        "from .test_faces import _head": "tests.test_faces",
        "from . import test_faces": "tests.test_faces",
        "from conftest import jpeg": "conftest",
    }
    for i, (line, module) in enumerate(caught.items()):
        path = tmp_path / f"m{i}.py"
        path.write_text(line + "\n")
        assert any(m == module and _is_test_module_or_conftest(m) for _, m in _imported(str(path))), line
    path = tmp_path / "helper.py"
    path.write_text("from tests.train_runs import train_argv\nfrom tests import tool_files\nimport pytest\n")
    assert not [m for _, m in _imported(str(path)) if _is_test_module_or_conftest(m)]

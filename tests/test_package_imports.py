"""The package imports through its one name: every module of the project is imported as
`shardface.<module>`, none edits `sys.path` or the environment, and the checkout runs its tools
and training from its root without installing (`shardface` there is a link to the root)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_PACKAGE = {"tests", "benchmarks", "examples", "docs", "shardface"}


def _project_names() -> set[str]:
    """The names of the package's top-level modules and subpackages."""
    names = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py") and n != "__init__.py"}
    return names | {
        n
        for n in os.listdir(ROOT)
        if n not in NOT_PACKAGE and os.path.isfile(os.path.join(ROOT, n, "__init__.py"))
    }


def _package_files() -> list[str]:
    found = [os.path.join(ROOT, n) for n in os.listdir(ROOT) if n.endswith(".py")]
    for name in _project_names():
        folder = os.path.join(ROOT, name)
        if os.path.isdir(folder):
            found += [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")]
    return sorted(found)


def _is(node: ast.AST, dotted: str) -> bool:
    return ast.unparse(node) == dotted


# functions that run only in a worker process of ours, on its own state: the pool's initializer
# gives the worker the parent's environment (a forkserver's workers would have the server's)
IN_A_WORKER = {"_start_worker"}


def _walk_outside_workers(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef) and node.name in IN_A_WORKER:
            continue
        yield node
        yield from _walk_outside_workers(node)


def _global_writes(tree: ast.AST) -> list[str]:
    """Lines that change sys.path or os.environ (outside a worker's own initializer)."""
    said = []
    for node in _walk_outside_workers(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            base = t.value if isinstance(t, ast.Subscript) else t
            if _is(base, "sys.path") or _is(base, "os.environ"):
                said.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, verb = node.func.value, node.func.attr
            if _is(owner, "sys.path") and verb in {"insert", "append", "extend", "remove", "pop", "clear"}:
                said.append(f"{node.lineno}: {ast.unparse(node)}")
            if _is(owner, "os.environ") and verb in {"update", "pop", "clear", "setdefault", "popitem"}:
                said.append(f"{node.lineno}: {ast.unparse(node)}")
            if _is(node.func, "os.putenv") or _is(node.func, "os.unsetenv"):
                said.append(f"{node.lineno}: {ast.unparse(node)}")
    return said


def test_no_module_of_the_package_edits_sys_path_or_the_environment():
    files = _package_files()
    assert any(f.endswith(os.path.join("faces", "stream.py")) for f in files)  # the scan sees the tree
    found = []
    for path in files:
        with open(path) as f:
            found += [f"{os.path.relpath(path, ROOT)}:{line}" for line in _global_writes(ast.parse(f.read()))]
    assert not found, found


def test_the_scan_finds_each_kind_of_global_write():
    source = "import os, sys\nsys.path[0] = 'x'\nsys.path.insert(0, 'y')\nos.environ['A'] = '1'\ndel os.environ['A']\n"
    assert len(_global_writes(ast.parse(source))) == 4
    nested = "def f():\n    def g():\n        os.environ.update(x)\ndef _start_worker():\n    os.environ.update(x)\n"
    assert len(_global_writes(ast.parse(nested))) == 1


def test_every_import_of_a_project_module_goes_through_shardface():
    names = _project_names()
    assert {"configs", "faces", "train", "errors"} <= names
    flat = []
    for folder in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")):
        paths = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".py")]
        for path in paths + [f for f in _package_files() if folder == ROOT]:
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                else:
                    continue
                flat += [
                    f"{os.path.relpath(path, ROOT)}:{node.lineno}"
                    for m in modules
                    if m.split(".")[0] in names
                ]
    assert not flat, f"flat imports (import them as shardface.<module>): {sorted(set(flat))}"


@pytest.mark.parametrize("command", [["-m", "scripts.verify", "--help"], ["train.py", "--help"]])
def test_the_checkout_runs_its_tools_and_training_from_its_root_without_installing(command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout or "--network" in done.stdout

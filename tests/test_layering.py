"""The one-way layering docs/architecture.md states: a package imports only from packages in layers below it."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# lowest first; a module may import its own layer's package and any earlier layer
LAYERS = [
    ["configs"],
    ["parallel"],
    ["utils"],
    ["checkpoint"],
    ["backbones", "losses"],
    ["heads"],
    ["dataset"],
    ["faces"],
    ["infer"],
    ["distill"],
    ["eval"],
    ["builders", "planner", "train"],
    ["scripts"],
]
OURS = {name for layer in LAYERS for name in layer}


def _level(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def _imported_tops(path: str) -> set[str]:
    """Our top-level modules a file imports, each through the package (`shardface.<top>...`)."""
    tree = ast.parse(open(path).read(), path)
    modules = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules += (
                [f"{node.module}.{alias.name}" for alias in node.names]
                if node.module == "shardface"
                else [node.module]
            )
    return {m.split(".")[1] for m in modules if m.startswith("shardface.")} & OURS


def _sources():
    for top in sorted(OURS):
        if os.path.isfile(os.path.join(ROOT, f"{top}.py")):
            yield top, f"{top}.py"
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield top, os.path.relpath(os.path.join(dirpath, f), ROOT)


def test_the_scan_sees_imports_through_the_package():
    assert {"faces", "infer"} <= _imported_tops(os.path.join(ROOT, "infer", "stream.py"))
    assert {"backbones", "configs", "eval"} <= _imported_tops(os.path.join(ROOT, "scripts", "demo.py"))


@pytest.mark.parametrize("top,path", list(_sources()))
def test_module_imports_only_from_its_layer_or_below(top, path):
    upward = sorted(n for n in _imported_tops(os.path.join(ROOT, path)) if _level(n) > _level(top))
    assert not upward, f"{path} ({top}) imports from a higher layer: {upward}"


@pytest.mark.parametrize("path", ["builders.py", "planner.py"])
def test_training_builds_models_and_teachers_through_infer_not_eval(path):
    """Training loads models and teachers through infer/ and distill/; of eval/ it runs only the
    verification protocol (train.py's callback)."""
    assert "eval" not in _imported_tops(os.path.join(ROOT, path))

"""`pip install .` ships one package, `shardface`: the checkout's root with every package folder,
every top-level module and every command-line tool's module; the installed copy works outside the
repository, beside a user's own `utils.py`, `dataset/` and `configs.py`."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a build must not see of this checkout: local state and what earlier builds left behind
_NOT_SOURCES = {"work_dirs", "data", "output", "build", "dist"}


def _package_folders() -> list[str]:
    """Every top-level folder with an __init__.py: a subpackage the wheel must hold (tests/ has none)."""
    return sorted(
        name
        for name in os.listdir(ROOT)
        if not name.startswith(".")
        and not os.path.islink(os.path.join(ROOT, name))
        and os.path.isfile(os.path.join(ROOT, name, "__init__.py"))
    )


def _top_modules() -> list[str]:
    return sorted(name[:-3] for name in os.listdir(ROOT) if name.endswith(".py"))


def _entry_points() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _source_copy(dest: str) -> str:
    """This checkout's sources in `dest`: the build runs there, so it leaves no build/ or egg-info here."""

    def ignore(folder, names):
        if os.path.abspath(folder) != ROOT:
            return [n for n in names if n == "__pycache__"]
        return [n for n in names if n.startswith(".") or n in _NOT_SOURCES or n.endswith(".egg-info")]

    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)  # `shardface`, the link to the root, stays one
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel `pip wheel .` builds from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = _source_copy(str(tmp / "source"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(tmp / "dist"),
            source,
        ],
        check=True,
        cwd=str(tmp),
    )
    (found,) = os.listdir(tmp / "dist")
    return str(tmp / "dist" / found)


def _wheel_names(wheel: str) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_the_wheel_holds_one_top_level_name_shardface_with_every_package_folder_and_module(wheel):
    names = _wheel_names(wheel)
    assert "infer" in _package_folders() and "distill" in _package_folders()  # the scan sees the tree
    assert {"builders", "planner", "train", "errors", "__init__"} <= set(_top_modules())
    tops = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert tops == {"shardface"}, f"site-packages would get {sorted(tops)}"
    missing = [f"{m}.py" for m in _top_modules() if f"shardface/{m}.py" not in names]
    for package in _package_folders():
        for f in sorted(os.listdir(os.path.join(ROOT, package))):
            if f.endswith(".py") and f"shardface/{package}/{f}" not in names:
                missing.append(f"{package}/{f}")
    assert not missing, f"the wheel lacks {missing}"
    folders = {n.split("/")[1] for n in names if n.startswith("shardface/") and n.count("/") >= 2}
    assert folders == set(_package_folders()), (
        "only the package folders are shipped (not tests/, benchmarks/…)"
    )


def test_the_packages_pyproject_lists_are_the_trees_package_folders():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = tomllib.load(f)["tool"]["setuptools"]["packages"]
    assert listed == ["shardface"] + [f"shardface.{p}" for p in _package_folders()]


def _defines(source: str, name: str) -> bool:
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            return True
    return False


def test_every_command_line_tool_resolves_to_a_module_in_the_wheel(wheel):
    names = _wheel_names(wheel)
    with zipfile.ZipFile(wheel) as z:
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
        for tool, target in _entry_points().items():
            assert f"{tool} = {target}" in entry_points, f"{tool} is not among the wheel's console scripts"
            module, function = target.split(":")
            path = module.replace(".", "/")
            assert module.startswith("shardface."), f"{tool} = {target}: not in the package"
            found = [p for p in (f"{path}.py", f"{path}/__init__.py") if p in names]
            assert found, f"{tool} = {target}: the wheel has no module {module}"
            assert _defines(z.read(found[0]).decode(), function), (
                f"{tool} = {target}: {found[0]} defines no {function}"
            )


USER_FILES = {
    "utils.py": "raise ImportError('the user utils.py was imported')\n",
    "dataset/__init__.py": "DataError = None  # a user's own package\n",
    "configs.py": "raise ImportError('the user configs.py was imported')\n",
    "eval.py": "raise ImportError('the user eval.py was imported')\n",
    "scripts/__init__.py": "",
    "train.py": "raise ImportError('the user train.py was imported')\n",
}

USE_THE_API = """
import shardface
from shardface import Gallery, load_model
import shardface.train, shardface.scripts.align
print(shardface.__file__, shardface.train.__file__, shardface.scripts.align.__file__)
print(sorted(shardface.__all__))
print(load_model("dlib").name)
"""


def test_the_installed_package_works_beside_a_users_own_utils_dataset_and_configs(wheel, tmp_path):
    """Installed from the wheel and used from a folder holding a user's own modules of the names
    the project's folders have, the API and a tool run from the installed copy alone."""
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    for name, text in USER_FILES.items():
        (elsewhere / name).parent.mkdir(parents=True, exist_ok=True)
        (elsewhere / name).write_text(text)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            wheel,
        ],
        check=True,
        cwd=str(elsewhere),
    )
    assert sorted(os.listdir(target)) == [
        "bin",
        "shardface",
        *[n for n in os.listdir(target) if n.endswith(".dist-info")],
    ]
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", USE_THE_API], cwd=str(elsewhere), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    paths, public, name = done.stdout.splitlines()
    assert all(path.startswith(str(target)) for path in paths.split()), paths
    assert "load_model" in public and "Gallery" in public and "UserError" in public
    assert name == "dlib"
    tool = subprocess.run(
        [str(target / "bin" / "shardface-identify"), "--help"],
        cwd=str(elsewhere),
        env=env,
        capture_output=True,
        text=True,
    )
    assert tool.returncode == 0, tool.stderr
    assert "--gallery" in tool.stdout

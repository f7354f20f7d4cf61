"""Config loading: base defaults <- job config <- `--key value` overrides."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import traceback
from typing import Any, Callable, Sequence

from easydict import EasyDict as edict

from shardface.configs.schema import defaults, dump, keys
from shardface.configs.validate import validate_config
from shardface.errors import ConfigError

__all__ = [
    "ConfigError",
    "get_config",
    "resolve_config_path",
    "format_config",
    "save_config",
    "parse_value",
    "validate_config",
]


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_config_path(path: str) -> str:
    """The config file `path` names: as given (cwd), else a shipped config by the same name
    (`configs/ms1mv3_r50`, `ms1mv3_r50`), so installed or checked-out configs work from anywhere."""
    candidates = [
        path,
        os.path.join(_PACKAGE_ROOT, path),
        os.path.join(_PACKAGE_ROOT, "configs", os.path.basename(path)),
    ]
    for candidate in candidates:
        for name in (candidate, candidate + ".py"):
            if name.endswith(".py") and os.path.isfile(name):
                return name
    raise ConfigError(
        f"config file not found: {path} (nor a shipped config of that name in "
        f"{os.path.join(_PACKAGE_ROOT, 'configs')})"
    )


def _load_module_config(path: str) -> dict:
    """The `config` mapping of the job config file at `path`; anything wrong with the file (it
    does not parse, raises, or sets no mapping `config`) is a ConfigError naming the file and line."""
    spec = importlib.util.spec_from_file_location("shardface_job_config", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:  # the file's own line (an imported file's error names that file instead)
        raise ConfigError(
            f"{exc.filename or path}:{exc.lineno}: {exc.msg} (a syntax error in the config file)"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"{path}:{_line_in(path, exc.__traceback__)}: {type(exc).__name__}: {exc} (raised "
            f"while running the config file)"
        ) from None
    if not hasattr(module, "config"):
        raise ConfigError(f"{path} defines no `config`")
    if not isinstance(module.config, dict):
        raise ConfigError(
            f"{path}:{_assignment_line(path)}: config is {type(module.config).__name__} "
            f"{module.config!r:.40}, expected a mapping of keys (an edict, as in configs/base.py)"
        )
    return dict(module.config)


def _line_in(path: str, tb) -> int | str:
    """The line of `path` in traceback `tb` nearest the error (a call into another file is
    reported at the config file's line that made it)."""
    lines = [
        frame.lineno
        for frame in traceback.extract_tb(tb)
        if os.path.abspath(frame.filename) == os.path.abspath(path)
    ]
    return lines[-1] if lines else "?"


def _assignment_line(path: str) -> int | str:
    """The line of the last top-level `config = ...` in `path`."""
    try:
        tree = ast.parse(open(path).read(), path)
    except (OSError, SyntaxError, ValueError):
        return "?"
    found = [
        node.lineno
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "config"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    return found[-1] if found else "?"


def _unknown(unknown: dict[str, list[str]], known: Sequence[str]) -> ConfigError:
    """One error naming every unknown key of every source; a hint only for keys near a known one."""
    parts = []
    for where, names in unknown.items():
        named = []
        for key in names:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
            named.append(f"'{key}'" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
        parts.append(f"{', '.join(named)} in {where}")
    count = sum(len(names) for names in unknown.values())
    return ConfigError(
        f"unknown config key{'s' if count > 1 else ''} {'; '.join(parts)}; "
        f"`python train.py --help` lists every key"
    )


def parse_value(text: str, key: str) -> Any:
    """A command-line string read as its key's kind reads it (configs/schema.py)."""
    return keys()[key].kind.parse(text)


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --key value, got '{arg}'")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"missing value for {arg}")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def get_config(path: str | None = None, argv: Sequence[str] = ()) -> edict:
    """Resolve base defaults, the job config at `path`, then `--key value` overrides."""
    cfg = edict(defaults())
    unknown: dict[str, list[str]] = {}
    if path:
        path = resolve_config_path(path)
        job = _load_module_config(path)
        unknown[path] = [key for key in job if key not in cfg]
        cfg.update({key: value for key, value in job.items() if key in cfg})
        if cfg.output is None:  # arcface_torch's meaning: work_dirs/<config file name>
            cfg.output = os.path.join("work_dirs", os.path.splitext(os.path.basename(path))[0])
    overrides = parse_overrides(argv)
    unknown["command line"] = [key for key, _ in overrides if key not in cfg]
    unknown = {where: names for where, names in unknown.items() if names}
    if unknown:
        raise _unknown(unknown, list(cfg))
    for key, text in overrides:
        try:
            cfg[key] = parse_value(text, key)
        except ValueError as exc:
            raise ConfigError(f"--{key}: {exc}") from None
    validate_config(cfg)
    return cfg


def format_config(cfg: dict) -> str:
    """The resolved config for training.log, secret values hidden (configs/schema.py)."""
    return dump(cfg)


def save_config(cfg: dict, output: str, write_text: Callable[[str, str], None]) -> str:
    """Write the resolved config as `output/config.json` with `write_text(path, text)`, an
    atomic writer (checkpoint.files.atomic_write_text; checkpoint sits above configs), so a crash
    mid-write never leaves a torn config.json beside model.pt. Returns its path."""
    path = os.path.join(output, "config.json")
    write_text(path, json.dumps(dict(cfg), indent=2, sort_keys=True, default=list))
    return path

"""Config loading: base defaults <- job config <- `--key value` overrides."""
from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
from typing import Any, Callable, Sequence

from easydict import EasyDict as edict

from configs.base import config as _base
from configs.errors import ConfigError
from configs.validate import validate_config

__all__ = ["ConfigError", "get_config", "format_config", "save_config", "parse_value", "validate_config"]


def _load_module_config(path: str) -> dict:
    if not path.endswith(".py"):
        path = path + ".py"
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location("shardface_job_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "config"):
        raise ConfigError(f"{path} defines no `config`")
    return dict(module.config)


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key '{key}' in {where}{hint}")


def parse_value(text: str, default: Any, key: str = "") -> Any:
    """Parse a command-line string to the type of the key's default."""
    if key == "resume" and text.lower() == "auto":
        return "auto"
    if isinstance(default, bool):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected a boolean, got '{text}'")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, (list, tuple)):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = [v for v in text.split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return type(default)(value)
    if default is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
    return text


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
    cfg = edict(dict(_base))
    if path:
        for key, value in _load_module_config(path).items():
            if key not in cfg:
                raise _unknown(key, list(cfg), path)
            cfg[key] = value
    for key, text in parse_overrides(argv):
        if key not in cfg:
            raise _unknown(key, list(cfg), "command line")
        try:
            cfg[key] = parse_value(text, _base[key], key)
        except ValueError as exc:
            raise ConfigError(f"--{key}: {exc}") from None
    validate_config(cfg)
    return cfg


def format_config(cfg: dict) -> str:
    width = max(len(k) for k in cfg)
    return "\n".join(f"{k.ljust(width)} : {cfg[k]!r}" for k in sorted(cfg))


def save_config(cfg: dict, output: str, write_text: Callable[[str, str], None]) -> str:
    """Write the resolved config as `output/config.json` with `write_text(path, text)`, an
    atomic writer (utils.checkpoint.atomic_write_text; utils sits above configs), so a crash
    mid-write never leaves a torn config.json beside model.pt. Returns its path."""
    path = os.path.join(output, "config.json")
    write_text(path, json.dumps(dict(cfg), indent=2, sort_keys=True, default=list))
    return path

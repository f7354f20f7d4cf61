"""What every command-line tool in scripts/ shares: option spellings and help texts.

`ArgumentParser` accepts each option with dashes or underscores (`--batch-size` and
`--batch_size`), as train.py does for config keys, and shows the underscore spelling in `-h`.
Every argument it is given must have a help text. A tool's `--seed` is declared with
`add_seed`, which keeps one rule for every tool: numpy's, an integer >= 0 (Python's `random`
takes negative seeds, numpy refuses them; train.py's `seed` key is held to the same). The
tools' entry points are wrapped in `parallel.user_errors.exits_on_user_error`, so a config,
data or checkpoint error is one line, `error: <message>`, with exit code 2."""

from __future__ import annotations

import argparse
import sys

from shardface.errors import ConfigError


def underscored(token: str) -> str:
    """`--batch-size[=v]` -> `--batch_size[=v]`; anything that is not a long option unchanged."""
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with both spellings of every long option, and help required."""

    def add_argument(self, *names, **kwargs):
        if not kwargs.get("help"):
            raise TypeError(f"{names[0] if names else kwargs.get('dest')}: every argument needs a help text")
        return super().add_argument(*(underscored(n) for n in names), **kwargs)

    def add_seed(self, default: int | None, help: str):
        """`--seed`, an integer >= 0 (numpy's rule), refused otherwise as one line (ConfigError)."""
        self._seeded = True
        return self.add_argument("--seed", type=int, default=default, help=f"{help}; an integer >= 0")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after `--` everything is positional
        parsed, rest = super().parse_known_args([underscored(a) for a in args[:end]] + args[end:], namespace)
        seed = getattr(parsed, "seed", None) if getattr(self, "_seeded", False) else None
        if seed is not None and seed < 0:
            raise ConfigError(
                f"--seed {seed}: a seed is an integer >= 0 (numpy's rule, which every tool keeps)"
            )
        return parsed, rest

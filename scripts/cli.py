"""What every command-line tool in scripts/ shares: option spellings and help texts.

`ArgumentParser` accepts each option with dashes or underscores (`--batch-size` and
`--batch_size`), as train.py does for config keys, and shows the underscore spelling in
`-h`. Every argument it is given must have a help text. The tools' entry points are wrapped
in `parallel.user_errors.exits_on_user_error`, so a config, data or checkpoint error is one
line, `error: <message>`, with exit code 2."""
from __future__ import annotations

import argparse
import sys


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

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after `--` everything is positional
        return super().parse_known_args([underscored(a) for a in args[:end]] + args[end:], namespace)

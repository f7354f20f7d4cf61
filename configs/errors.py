class UserError(Exception):
    """Bad input the user can fix (a config, data or checkpoint problem): the command-line
    tools print its message as one line, `error: <message>`, and exit 2 (no traceback unless
    SHARDFACE_DEBUG=1; see parallel/user_errors.py). Each subclass also keeps the built-in
    base it had before, so `except ValueError` / `except RuntimeError` still catch it."""


class ConfigError(UserError, ValueError):
    """A config file, key or value that is wrong (the message names it)."""

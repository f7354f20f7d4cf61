"""What a user can get wrong, by meaning. The tools print such an error as one line, `error:
<message>`, and exit 2 (no traceback unless SHARDFACE_DEBUG=1; see parallel/user_errors.py).
Each class also keeps the built-in base it had before, so `except ValueError` /
`except RuntimeError` still catch it. This module imports nothing of the project: every layer
raises these."""


class UserError(Exception):
    """Bad input the user can fix; the message names the file, record, key or option."""


class ConfigError(UserError, ValueError):
    """A config file, key, value or command-line option that is wrong."""


class DataError(UserError, ValueError):
    """Data that is missing or malformed: a file, image, label, pair list or cache."""


class ModelError(UserError, RuntimeError):
    """A model, checkpoint or weights file that is missing, unreadable, does not fit, or computes
    non-finite values."""


class OutputError(UserError, ValueError):
    """An output that cannot be written where asked, exists without --overwrite, or is an input."""

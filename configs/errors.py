class ConfigError(ValueError):
    """A config file, key or value that is wrong (the message names it)."""

"""The error of a model config that cannot be built or loaded."""


class ConfigError(ValueError):
    """A model config that we cannot load; the message names the field (and the file, when there is one)."""

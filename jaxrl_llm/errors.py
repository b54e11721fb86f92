"""Errors that modules on different floors of the package raise alike, so that neither imports the other."""


class ConfigValueError(ValueError):
    """A config value that cannot work; the message names the gin binding to change."""

"""Errors that modules on different floors of the package raise alike, so that neither imports the other."""


class ConfigValueError(ValueError):
    """A config value that cannot work; the message names the gin binding to change."""


class DeviceMemoryError(ConfigValueError):
    """A run that cannot fit the device's memory, found before any work (an out-of-memory is bad input, not a
    crash mid-step); the message names the program, its sizes and the keys that shrink it."""

"""The one error of the data package."""


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file (and row and field) and the fix."""

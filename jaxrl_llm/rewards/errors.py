"""The two errors of the rewards package: a bad configuration, and a reward function that failed."""


class RewardConfigError(ValueError):
    """The reward setup is wrong (unknown data_source, bad custom reward file, ...); fix the config."""


class RewardError(RuntimeError):
    """A reward function raised on a sample while `RewardManager(strict=True)`."""

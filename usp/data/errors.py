"""The one exception type of the data layer."""


class DataError(ValueError):
    """A problem with the `data.*` config: the message names the key, the value and the fix."""

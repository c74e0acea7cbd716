"""The one exception type of the data layer."""
from usp.errors import UspError


class DataError(UspError):
    """A problem with the `data.*` config: the message names the key, the value and the fix."""

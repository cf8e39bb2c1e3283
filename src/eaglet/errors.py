"""The one exception type users see."""


class EagletError(Exception):
    """A user-facing error: printed as one line, exit code 2."""

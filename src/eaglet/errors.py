"""The one exception type users see."""


class EagletError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


class AwaitedFile(EagletError):
    """A file the params name that only a later stage reads is not there yet (a held-out
    suite): that stage waits for it, every other artifact builds."""

    def __init__(self, message: str, file: str, field: str):
        super().__init__(message)
        self.file, self.field = file, field

"""The one exception type users see: a clear message naming the file, field or value."""


class SpecDecodeError(Exception):
    """A user-facing error. The CLI prints its message on one line and exits non-zero."""

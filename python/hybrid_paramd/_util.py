"""Small helpers the client modules share: C API status to exception, and
timeouts in milliseconds."""

from . import errors


def raise_for(code, status):
    """Raises the hybrid_paramd.Error subclass of `code` (0: nothing)."""
    if code != 0:
        raise errors.from_code(code, status.message.decode("utf-8", "replace"))


def ms(seconds):
    """A timeout in seconds (None: the library's default) as the C API's
    milliseconds (0: default; at least 1 otherwise)."""
    return 0 if seconds is None else max(1, int(seconds * 1000))

"""The error bad input data raises: its own module, so the row checks of every shape
(`loading`, `tool_rows`) share it without importing each other."""

from __future__ import annotations

# Error messages quote what they found; a huge value must not make a huge message.
_MAX_MESSAGE = 2000


class DataError(ValueError):
    """Bad input data; the message names the file and line or row."""

    def __init__(self, message: str) -> None:
        if len(message) > _MAX_MESSAGE:
            message = f"{message[:_MAX_MESSAGE]}... ({len(message)} characters in all)"
        super().__init__(message)


class RowsTooLong(DataError):
    """No row fits the section's `max_seq_len`: the message gives the rows' token counts and the
    `max_seq_len` that would keep them."""

"""A job's error message as stored and as answered: one short line.

Standard library only: the job's child process (`entrypoints.server.child`) imports it before it is bound to its
parent.
"""

from __future__ import annotations

# A job's error message, as stored and as answered, is one line of at most this many characters: a library's error
# can be megabytes (one named every parameter of a refused flow run).
MAX_MESSAGE_CHARS = 500


def short_message(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_MESSAGE_CHARS else line[: MAX_MESSAGE_CHARS - 3] + "..."

"""The one `error:` line a bad input gets: bounded, whatever the input's size or where the error was raised."""

from __future__ import annotations

MAX_CHARS = 1000  # under PIPE_BUF (4096 bytes) even in UTF-8: ranks sharing a pipe write the line whole


def error_line(error: BaseException) -> str:
    """`error: <message>` on one line of at most about MAX_CHARS characters. A data loader worker's error comes
    back wrapped in its traceback (torch's `ExceptionWrapper`): its own message is the last line. A message
    that quotes a huge value (a 50 MB `job.name`) is cut, saying how much was left out."""
    text = str(error).strip()
    if "\nOriginal Traceback" in text:
        last = text.splitlines()[-1]
        text = last.partition(": ")[2] or last
    text = " ".join(text.splitlines())
    if len(text) > MAX_CHARS:
        text = f"{text[:MAX_CHARS]}... ({len(text) - MAX_CHARS} more characters)"
    return f"error: {text}"

"""Publishing a file whole: a reader finds the old file or the new one, never a torn one.

The bytes go to `.<name>.partial` beside the target (opened without following a symlink), are fsynced,
and the temporary is renamed over the target (`os.replace` replaces a symlink there, never writes through
it). On an error the temporary goes and the target is as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def write_atomically(path: Path, data: bytes | memoryview | str) -> None:
    """`data` (bytes or a byte buffer, or text written as UTF-8) to `path`; OSError as the system raised it."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with os.fdopen(os.open(tmp, _CREATE, 0o644), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if not tmp.is_symlink():
            tmp.unlink(missing_ok=True)
        raise

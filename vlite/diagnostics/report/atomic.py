"""Write a report file whole or not at all: a watch rewrites its report at each idle point, and a
Ctrl-C (or a kill) during a rewrite must leave the last complete file, never a truncated one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory, flushed to disk,
    then ``os.replace``: a reader sees the old file or the new one, never a part of either.

    Raises:
        OSError: the directory cannot be written (the temporary file is removed).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt included: no stray temporary file
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

"""Worker side: what a worker prints (behemoth's own lines; the host keeps its per-report log out)."""

from __future__ import annotations

import sys


def console(message: str) -> None:
    """A line for the user's console. Not print(): Ray Train's print patch would show it twice."""
    sys.stdout.write(f"[behemoth] {message}\n")
    sys.stdout.flush()

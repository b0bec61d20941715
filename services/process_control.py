"""Linux process controls the server's processes set on themselves (prctl), shared by the engine's
tensor-parallel followers and the verifier's engine processes."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent() -> None:
    """SIGKILL when the process (the thread) that started this one ends, however it ends (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def name_this_process(name: bytes) -> None:
    """The name `ps -o comm`, top and pgrep show (Linux, 15 bytes); the command line is unchanged."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]))

"""Local TCP ports for the processes tuneloop starts (training rendezvous, servers), and
stopping those processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Run by die_with_parent(): ask Linux for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG,
# which exec keeps), give up if it has already died, then become the command.
_DIE_WITH_PARENT = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: list[str]) -> list[str]:
    """argv, run so that it gets SIGTERM when the thread that starts it dies. For a helper
    server started in its own session and stopped by the same call that started it (infra
    validation): if that process is killed first (a Prefect worker stopped mid-run), the
    server goes too instead of serving on as an orphan. Same pid, same process group as argv
    alone; elsewhere than Linux, argv unchanged."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def stop_process_group(proc: subprocess.Popen, term_wait: float = 20.0, kill_wait: float = 10.0) -> None:
    """Stop a process started with start_new_session=True and everything it started (its
    process group): SIGTERM, then SIGKILL if it has not exited within term_wait."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue

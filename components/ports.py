"""Local TCP ports for the processes tuneloop starts (training rendezvous, servers), and
stopping those processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

"""Turns on the CPU for the server's tensor work: the generation engine's steps and the
content filter's encoder batches run one after the other, never at the same time.

Why: on a CPU host each of them runs a torch intra-op (OpenMP) team as wide as the cores.
Run side by side, the two teams share the cores and every parallel region of the engine
waits at its barrier for a thread that the encoder's team has pushed off a core, so the
engine loses more than the encoder's own work (measured on two cores: the same encoder
load took 18 % more of the engine's throughput side by side than in turns). In turns, an
encoder batch costs the engine exactly its wall time, which `tuneloop_cpu_turn_seconds_total`
counts per holder, so the filter's share of the server is read off the metric.

Turns are served in arrival order (a ticket lock): the engine takes a turn per step, so a
waiting encoder batch runs after at most one step, and the engine goes on right after it.
Off (the default in a process that never enables them), turn() costs nothing.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable


class CpuTurns:
    def __init__(self) -> None:
        self.enabled = False
        self._cond = threading.Condition()
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket whose turn it is
        self.seconds: dict[str, float] = {}  # holder -> seconds held
        self.on_turn: Callable[[str, float], None] | None = None  # (holder, seconds) after each turn

    def enable(self, on_turn: Callable[[str, float], None] | None = None) -> None:
        self.enabled = True
        if on_turn is not None:
            self.on_turn = on_turn

    @contextmanager
    def turn(self, holder: str):
        if not self.enabled:
            yield
            return
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()
        started = time.perf_counter()
        try:
            yield
        finally:
            held = time.perf_counter() - started
            with self._cond:
                self._serving += 1
                self.seconds[holder] = self.seconds.get(holder, 0.0) + held
                self._cond.notify_all()
            if self.on_turn is not None:
                self.on_turn(holder, held)


# One per process: the engine's thread and the filter's worker threads share it.
CPU_TURNS = CpuTurns()

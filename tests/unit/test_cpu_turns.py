"""The CPU's turns (tuneloop/cpu_turns.py): the engine's steps and the filter's encoder
batches never run at the same time, turns go in arrival order, time held is counted."""

from __future__ import annotations

import threading
import time

from tuneloop.cpu_turns import CpuTurns


def test_off_turns_cost_nothing_and_count_nothing():
    turns = CpuTurns()
    with turns.turn("engine"):
        with turns.turn("filter"):  # no lock while off: nesting cannot deadlock
            pass
    assert turns.seconds == {}


def test_holders_never_overlap_and_time_is_counted():
    turns = CpuTurns()
    seen: list[tuple[str, float]] = []
    turns.enable(lambda holder, s: seen.append((holder, s)))
    inside, overlaps = [], []

    def work(holder: str, n: int, hold_s: float) -> None:
        for _ in range(n):
            with turns.turn(holder):
                inside.append(holder)
                if len(inside) > 1:
                    overlaps.append(list(inside))
                time.sleep(hold_s)
                inside.remove(holder)

    threads = [
        threading.Thread(target=work, args=("engine", 30, 0.002)),
        threading.Thread(target=work, args=("filter", 10, 0.005)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
    assert len([h for h, _ in seen if h == "engine"]) == 30 and len([h for h, _ in seen if h == "filter"]) == 10
    assert turns.seconds["engine"] >= 30 * 0.002 and turns.seconds["filter"] >= 10 * 0.005


def test_a_waiting_holder_gets_the_next_turn():
    """Arrival order: an engine that takes turn after turn cannot starve a waiting encoder
    batch; it waits at most the turn in progress."""
    turns = CpuTurns()
    turns.enable()
    order: list[str] = []
    stop = threading.Event()
    engine_turns = [0]

    def engine() -> None:
        while not stop.is_set():
            with turns.turn("engine"):
                engine_turns[0] += 1
                order.append("engine")
                time.sleep(0.01)

    t = threading.Thread(target=engine)
    t.start()
    time.sleep(0.05)
    asked = time.perf_counter()
    with turns.turn("filter"):
        waited = time.perf_counter() - asked
        order.append("filter")
    stop.set()
    t.join()
    assert waited < 0.05  # one engine turn (10 ms) at most, with room for a busy machine
    i = order.index("filter")
    assert order[i + 1 : i + 2] in (["engine"], [])  # the engine went on right after

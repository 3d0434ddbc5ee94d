"""data/background.in_background: items ahead in a thread, exceptions raised in the consumer, and a clean
stop, also when a second Ctrl-C arrives while the reader stops (issue 28: it printed a traceback)."""

from __future__ import annotations

import gc
import itertools
import queue
import sys
import threading

import pytest

from bmtrain_cli.data.background import in_background


def test_items_in_order_and_errors_reach_the_consumer():
    assert list(in_background(lambda: iter(range(5)), ahead=2)) == [0, 1, 2, 3, 4]

    def broken():
        yield 1
        raise ValueError("bad record")

    it = in_background(broken)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad record"):
        next(it)


def test_ctrl_c_while_a_collected_reader_stops_leaves_no_traceback(monkeypatch):
    """The generator is closed by garbage collection (as when the loop drops its iterator) and Ctrl-C
    arrives during the wait for the reader thread: nothing is printed as an unraisable exception and the
    thread ends."""
    it = in_background(itertools.count, ahead=1, name="bmtrain-test-reader")
    assert next(it) == 0
    real_get = queue.Queue.get

    def interrupted_get(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread() and kwargs.get("timeout") == 0.1:
            raise KeyboardInterrupt
        return real_get(self, *args, **kwargs)

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(queue.Queue, "get", interrupted_get)
    del it
    gc.collect()
    monkeypatch.undo()
    assert unraisable == []
    reader = [t for t in threading.enumerate() if t.name == "bmtrain-test-reader"]
    for t in reader:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in reader)

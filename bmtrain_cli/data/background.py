"""Running a generator in a thread, one item ahead, with a clean stop (streaming's reading thread)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator


def put_unless_stopped(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` (waiting while the queue is full); False when ``stop`` was set first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def in_background(make: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """The items of the generator ``make()``, made by a thread one item in advance: the next item is
    started when the previous one has been taken, so at most two are alive (the one in use, the next).

    Closing this generator stops the thread (and closes the generator there)."""
    q: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    taken = threading.Semaphore(0)
    done = object()

    def run() -> None:
        gen = make()
        try:
            for item in gen:
                if not put_unless_stopped(q, item, stop):
                    return
                del item
                while not taken.acquire(timeout=0.1):  # wait until it is taken
                    if stop.is_set():
                        return
            put_unless_stopped(q, done, stop)
        except BaseException as exc:  # re-raised in the consumer
            put_unless_stopped(q, exc, stop)
        finally:
            gen.close()

    t = threading.Thread(target=run, name="bmtrain-stream-read", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            taken.release()
            yield item
    finally:
        stop.set()
        while t.is_alive():
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        t.join()

"""Running a generator in a thread, some items ahead, with a clean stop (streaming's reading thread, the
cached loader's prefetch)."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generator, Iterator


def put_unless_stopped(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` (waiting while the queue is full); False when ``stop`` was set first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def in_background(
    make: Callable[[], Generator[Any, None, None]], ahead: int = 1, name: str = "bmtrain-stream-read"
) -> Iterator[Any]:
    """The items of the generator ``make()``, made by a thread ``ahead`` items in advance: an item is
    started only while fewer than ``ahead`` made ones wait untaken, so at most ``ahead + 1`` are alive (the
    one in use and those ahead; ahead 1: the one in use and the next).

    Exceptions in the thread are raised here. Closing this generator stops the thread (and closes the
    generator there)."""
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    q: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()
    taken = threading.Semaphore(ahead - 1)
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

    t = threading.Thread(target=run, name=name, daemon=True)
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
        try:
            while t.is_alive():
                try:
                    q.get(timeout=0.1)
                except queue.Empty:
                    pass
            t.join()
        except KeyboardInterrupt:
            # a second Ctrl-C while the reader stops (often in a garbage-collected close, where it would
            # print a traceback): the daemon thread sees ``stop`` and ends on its own
            pass

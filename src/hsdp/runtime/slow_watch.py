"""The slow-wait watchdog: one daemon thread per process that runs a callback when an
armed wait (a step agreement, a blocking host collective) has lasted ``SLOW_S``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SLOW_S = 1.0  # a wait lasting this long runs its callback (leaves a note for blocked peers)


class SlowWatch:
    """Runs a callback when an armed wait has lasted its time, from one daemon thread for
    the process (a ``threading.Timer`` per step starts a thread each time: about 0.5 ms of
    host time in every step's agreement)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._armed: tuple[float, Callable[[], None]] | None = None
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, fn: Callable[[], None]) -> tuple:
        with self._cv:
            if self._thread is None or not self._thread.is_alive():  # first use, or forked
                self._thread = threading.Thread(target=self._loop, name="hsdp-slow-watch",
                                                daemon=True)
                self._thread.start()
            self._armed = (time.monotonic() + seconds, fn)
            self._cv.notify()
            return self._armed

    def disarm(self, armed: tuple) -> None:
        with self._cv:
            if self._armed is armed:
                self._armed = None

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._armed is None or self._armed[0] > time.monotonic():
                    self._cv.wait(None if self._armed is None
                                  else self._armed[0] - time.monotonic())
                fn = self._armed[1]
                self._armed = None
            fn()


WATCH = SlowWatch()  # the process's one watchdog thread

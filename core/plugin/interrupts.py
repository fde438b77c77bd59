"""Telling a real Ctrl-C from a plugin that raises KeyboardInterrupt (or calls sys.exit) at import.

Plugin loading isolates every BaseException a plugin raises, SystemExit and KeyboardInterrupt
included: a plugin must not end every command. Only a KeyboardInterrupt that the user's Ctrl-C
(SIGINT) caused while plugins were loading is passed on. In the main thread, `watch_interrupts`
installs a SIGINT handler that records the signal before it raises (or calls the handler that
was there); elsewhere no signal can arrive, so every KeyboardInterrupt is the plugin's own.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class InterruptWatch:
    """`fired`: a SIGINT arrived while the watch was on."""

    fired: bool = False

    def is_real(self, exc: BaseException) -> bool:
        """True when `exc` is the user's Ctrl-C (to pass on), not something a plugin raised."""
        return isinstance(exc, KeyboardInterrupt) and self.fired


@contextmanager
def watch_interrupts() -> Iterator[InterruptWatch]:
    watch = InterruptWatch()
    if threading.current_thread() is not threading.main_thread():
        yield watch
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        watch.fired = True
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_DFL:
            raise KeyboardInterrupt
        return None  # SIG_IGN: ignored, as before

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGINT, previous)

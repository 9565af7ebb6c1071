"""Ctrl-C as a request to stop at the next safe point, instead of an exception raised wherever the main thread is.

A KeyboardInterrupt raised asynchronously can land inside a Ray call or a log writer's locked section and leave
either half-done, so the checkpoint written on the way out could hang or be inconsistent. Under
``stop_requests()`` the first SIGINT only sets a flag that the training loop reads at its safe points (the PPO
driver between its waits, at most a second apart; the GRPO driver between steps), so the loop itself raises
KeyboardInterrupt where nothing is half-done. A second SIGINT raises at once, for a user who does not want to wait.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def stop_requests(notice: str | None = None) -> Iterator[threading.Event]:
    """An event set by the first SIGINT while the block runs (the handler in force before is restored after);
    ``notice``, when given, goes to stderr at once, for loops whose safe point may be a while away.

    Off the main thread (where Python cannot install signal handlers) the event is never set and SIGINT keeps its
    usual effect.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def on_sigint(signum: int, frame: Any) -> None:
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        if notice:  # a raw write: print() from a signal handler can collide with a print it interrupted
            os.write(2, f"\n{notice}\n".encode())

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)

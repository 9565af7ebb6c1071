"""Ctrl-C (or SIGTERM, which ``ray job stop`` sends) as a request to stop at the next safe point, instead of an
exception raised wherever the main thread is.

A KeyboardInterrupt raised asynchronously can land inside a Ray call or a log writer's locked section and leave
either half-done, so the checkpoint written on the way out could hang or be inconsistent. Under
``stop_requests()`` the first SIGINT or SIGTERM only sets a flag that the training loop reads at its safe points
(the PPO driver between its waits, at most a second apart; the GRPO driver between steps), so the loop itself
raises KeyboardInterrupt where nothing is half-done, and the run leaves a checkpoint. A second signal raises at
once, for a user who does not want to wait.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_requests(notice: str | None = None) -> Iterator[threading.Event]:
    """An event set by the first SIGINT or SIGTERM while the block runs (the handlers in force before are restored
    after); ``notice``, when given, goes to stderr at once, for loops whose safe point may be a while away.

    Off the main thread (where Python cannot install signal handlers) the event is never set and the signals keep
    their usual effect.
    """
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def on_signal(signum: int, frame: Any) -> None:
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        if notice:  # a raw write: print() from a signal handler can collide with a print it interrupted
            os.write(2, f"\n{notice}\n".encode())

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

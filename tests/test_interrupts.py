"""``stop_requests``: the first Ctrl-C is a request a training loop honours at a safe point, a second one is not."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rlfabric.run.interrupts import stop_requests


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_first_signal_requests_a_stop_and_a_second_interrupts(first):
    """SIGTERM (what `ray job stop` sends) is a stop request like Ctrl-C."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with stop_requests() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), first)  # delivered to the main thread at the next bytecode
        assert stop.wait(5), "the first signal sets the event instead of raising"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            stop.wait(5)  # the handler raises here, in the main thread
    assert {sig: signal.getsignal(sig) for sig in before} == before  # the previous handlers are back


def test_off_the_main_thread_sigint_keeps_its_usual_effect():
    seen: list[bool] = []

    def body() -> None:
        with stop_requests() as stop:
            seen.append(stop.is_set())

    before = signal.getsignal(signal.SIGINT)
    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert seen == [False] and signal.getsignal(signal.SIGINT) is before

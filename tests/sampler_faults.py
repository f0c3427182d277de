"""Reward backends that fail in the asynchronous sampler's thread (named by class path in command-line runs,
tests/test_sampler_faults.py): one that raises, one that hangs, one bound to the trainer's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from rlhf_lightning.interfaces import RewardModel


def _count_e(responses: Sequence[str]) -> list[float]:
    return [float(response.count("e")) for response in responses]


class RaiseOnCall(RewardModel):
    """Scores as configs/tiny.yaml's reward does until call ``call`` (1-based), which raises ``error``
    (``RuntimeError`` or ``TimeoutError``: the backend's own, not the sampler's timeout)."""

    def __init__(self, call: int = 2, error: str = "RuntimeError") -> None:
        super().__init__()
        self.call, self.calls, self.error = call, 0, {"RuntimeError": RuntimeError, "TimeoutError": TimeoutError}[error]

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        self.calls += 1
        if self.calls == self.call:
            raise self.error("the scoring service went away")
        return _count_e(responses)


class HangOnCall(RewardModel):
    """Scores until call ``call``, which sleeps ``seconds`` (a hung backend: longer than the test waits)."""

    def __init__(self, call: int = 2, seconds: float = 3600.0) -> None:
        super().__init__()
        self.call, self.calls, self.seconds = call, 0, seconds

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        self.calls += 1
        if self.calls >= self.call:
            print("sampler-faults: hanging", flush=True)
            time.sleep(self.seconds)
        return _count_e(responses)


class MainThreadOnly(RewardModel):
    """A client bound to the thread that set it up: it raises when called from any other."""

    def setup(self, device) -> None:
        self.owner = threading.get_ident()

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        if threading.get_ident() != self.owner:
            raise RuntimeError("this client was created in another thread")
        return _count_e(responses)


class DeclaredMainThreadOnly(MainThreadOnly):
    """The same, declaring it (``RewardModel.thread_safe``)."""

    thread_safe = False

"""Shared by the tests of code timed by CUDA events: an event's timing API on the CPU."""

from __future__ import annotations


class FakeEvent:
    """A CUDA event's timing API on the CPU: ``at`` ms after an origin."""

    def __init__(self, at: float) -> None:
        self.at = at

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at - self.at

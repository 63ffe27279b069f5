"""Device seconds per kernel name, from the profiling events of the launches (for benchmarks:
where a slab's time goes)."""

from __future__ import annotations

from collections.abc import Iterable

import pyopencl as cl

from volconv.device.programs import device_seconds


class KernelClock:
    """`add` each launch's event under its kernel's name; `settle` (once the events are
    complete) adds their device seconds to `seconds`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._pending: list[tuple[str, cl.Event]] = []

    def add(self, name: str, event: cl.Event) -> cl.Event:
        self._pending.append((name, event))
        return event

    def settle(self) -> None:
        for name, event in self._pending:
            self.seconds[name] = self.seconds.get(name, 0.0) + device_seconds([event])
        self._pending.clear()


def merged(clocks: Iterable[KernelClock]) -> dict[str, float]:
    """The clocks' seconds summed by kernel name."""
    out: dict[str, float] = {}
    for clock in clocks:
        clock.settle()
        for name, seconds in clock.seconds.items():
            out[name] = out.get(name, 0.0) + seconds
    return out

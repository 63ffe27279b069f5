"""The engines a direct bank may run on, by name: the one registry. Each names its convolver and
its device test as ``"module:callable"``, imported when used, so that the plans may read the
registry without importing the engines (which import the plans). `volconv.engines.choose` is
the one place that chooses between them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pyopencl as cl


@dataclass(frozen=True)
class Engine:
    """A way to compute a plan's direct filters, named in the throughput record.

    ``convolver`` is ``"module:callable"``, a class or factory with
    `volconv.engines.direct.BankConvolver`'s constructor, slab interface and ``time_kernel``,
    imported when used (the engines import this module), which raises ValueError for a bank or
    type it does not take; ``supported`` is ``"module:function"`` of a device, whether the
    engine runs there (empty: everywhere); ``knobs``: whether the FP32 kernel's knobs (vector width,
    unroll, work-group) are its own, for `volconv.plan.tune` to search; ``sources``: its kernels/
    files. `volconv.plan.tune` times every available engine and caches the winner; untuned,
    `volconv.engines.choose.direct_plan` chooses by rule.
    """

    name: str
    convolver: str
    supported: str = ""
    knobs: bool = True
    sources: tuple[str, ...] = ()

    def load(self) -> Callable:
        return _load(self.convolver)

    def available(self, device: cl.Device) -> bool:
        return not self.supported or bool(_load(self.supported)(device))


def _load(name: str) -> Callable:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


# The engines, the FP32 kernel first (an untuned plan's, and every device's): the tensor cores
# on NVIDIA cc >= 8.0 (`volconv.engines.tensor`), for 8-bit inputs and, split into 8-bit digits,
# 16-bit integers and floats.
ENGINES: tuple[Engine, ...] = (
    Engine("fp32", "volconv.engines.direct:BankConvolver", sources=("bank_conv.cl",)),
    Engine("tensor", "volconv.engines.choose:tensor_convolver",
           "volconv.engines.tensor:tensor_supported", knobs=False,
           sources=("tensor_int8.cl", "digits.cl")),
)  # fmt: skip


def engine_candidates(device: cl.Device) -> tuple[Engine, ...]:
    """The `ENGINES` that run on ``device``, in order of preference."""
    return tuple(e for e in ENGINES if e.available(device))

"""The one place an engine is chosen for a direct bank, and where it is planned:
`direct_plan` (the tensor cores where the device and bank allow and they pay, else the FP32
kernel; the engine ``volconv bench --tune`` cached wins over the rule), `convolver_for` (the
engine's convolver of such a plan) and `direct_convolver` (both). ``VOLCONV_ENGINE=fp32`` (or
``engine='fp32'``) forces the FP32 kernel everywhere, for comparison.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pyopencl as cl

from volconv.engines.digits import DigitConvolver, DigitPlan, digit_types
from volconv.engines.direct import BankConvolver, as_kernel_bank
from volconv.engines.padder import native_volume
from volconv.engines.registry import ENGINES as REGISTRY
from volconv.engines.tensor import TensorConvolver, tensor_refusal
from volconv.plan.direct import Plan
from volconv.plan.knobs import tuned_knobs

ENGINES = ("auto", *(e.name for e in REGISTRY))  # what $VOLCONV_ENGINE may name
ENGINE_ENV = "VOLCONV_ENGINE"
# Below this many filters in a group 'auto' keeps the FP32 kernel (a tensor pass costs the same
# for 1..8 filters; measured: benchmarks/README.md, "The tensor-core engine").
MIN_TENSOR_FILTERS = 4
# int32 sums are exact: the error is the coefficients' 23-bit rounding, below the FP32 kernel's
# at every extent, so 'auto' takes the tensor cores at every extent; two digits (16-bit
# integers) only from MIN_SPLIT_TAPS taps, three (floats) never (benchmarks/README.md).
MIN_SPLIT_TAPS = 7**3


def tensor_pays(n_filters: int, extents: tuple[int, ...], digits: int = 1) -> bool:
    """Whether 'auto' takes the tensor cores for a group (where they exist) whose slab is
    ``digits`` 8-bit digits: faster from `MIN_TENSOR_FILTERS` filters, and more accurate than
    the FP32 kernel at every extent (INT8 sums are exact); two digits from `MIN_SPLIT_TAPS`
    taps, more never."""
    if n_filters < MIN_TENSOR_FILTERS:
        return False
    return digits == 1 or (digits == 2 and math.prod(extents) >= MIN_SPLIT_TAPS)


def choose_engine(engine: str | None = None) -> str:
    """``engine``, else $VOLCONV_ENGINE, else 'auto'; checked."""
    engine = engine or os.environ.get(ENGINE_ENV) or "auto"
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}; got {engine!r}")
    return engine


def direct_plan(
    kernels: object,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    mode: str = "reflect",
    cval: float = 0.0,
    *,
    device: cl.Device,
    engine: str | None = None,
    **overrides: object,
) -> Plan:
    """The plan of the direct engine for a bank, its engine chosen: the tensor cores where the
    device and bank allow it (`tensor_refusal`) and `auto_engine` takes them (a `Plan` of
    engine 'tensor'; a `DigitPlan` where the slab splits into digits), else the FP32 kernel's.
    ``engine`` ('auto', 'fp32', 'tensor'; default $VOLCONV_ENGINE or 'auto') forces one;
    'tensor' raises where it cannot. ``overrides``: the plan's knobs (`make_plan`)."""
    forced = choose_engine(engine)
    bank = as_kernel_bank(kernels)
    engine = forced
    if forced == "auto":
        tuned = bool(overrides.get("tuned", True))
        engine = auto_engine(device, bank, np.dtype(dtype), mode, cval, tuned=tuned)
    if engine == "tensor":
        reason = tensor_refusal(device, bank, np.dtype(dtype), mode, cval, split=True)
        if reason is None:
            cls = TensorConvolver if len(digit_types(dtype, mode, cval)) == 1 else DigitConvolver
            return cls.plan_for(bank, shape, dtype, mode, cval, device, engine="tensor",
                                **overrides)  # fmt: skip
        if forced == "tensor":
            raise ValueError(f"the tensor-core engine does not take this bank: {reason}")
    return BankConvolver.plan_for(bank, shape, dtype, mode, cval, device, engine="fp32",
                                  **overrides)  # fmt: skip


def convolver_for(
    kernels: object, dtype: np.dtype, plan: Plan, *, device: cl.Device, **options: object
) -> BankConvolver:
    """The convolver of a plan `direct_plan` made for ``kernels`` and volumes of ``dtype``:
    `DigitConvolver`, `TensorConvolver` or the FP32 `BankConvolver` by the plan's engine.
    ``options``: the tensor kernel's own (``shape_split``, ``emulate``)."""
    if plan.engine != "tensor":
        cls, options = BankConvolver, {}
    else:
        cls = DigitConvolver if isinstance(plan, DigitPlan) else TensorConvolver
    return cls(kernels, plan.shape, dtype, plan.mode, plan.cval, device=device, plan=plan,
               **options)  # fmt: skip


def direct_convolver(
    kernels: object,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    mode: str = "reflect",
    cval: float = 0.0,
    *,
    device: cl.Device,
    engine: str | None = None,
    **overrides: object,
) -> BankConvolver:
    """The direct engine for a bank, chosen and planned (`direct_plan`) and built
    (`convolver_for`). The convolver's ``engine`` attribute names the choice for the record."""
    options = {k: overrides.pop(k) for k in ("shape_split", "emulate") if k in overrides}
    plan = direct_plan(kernels, shape, dtype, mode, cval, device=device, engine=engine,
                       **overrides)  # fmt: skip
    return convolver_for(kernels, dtype, plan, device=device, **options)


def auto_engine(
    device: cl.Device,
    bank: np.ndarray,
    dtype: np.dtype,
    mode: str,
    cval: float,
    *,
    tuned: bool = True,
) -> str:
    """'auto''s engine for a bank: the one ``volconv bench --tune`` cached for this device,
    driver and bank shape (`volconv.plan.knobs.tuned_knobs`; ``tuned`` False skips it), else the
    rule: 'tensor' where the device and bank allow it and `tensor_pays` for the slab's
    digits (`digit_types`: 8-bit slabs, and 16-bit integers from `MIN_SPLIT_TAPS` taps),
    else 'fp32'; the tuner takes any of them where they measure faster."""
    src = native_volume(np.empty(0, dtype)).dtype
    extents = tuple(bank.shape[1:])
    knobs = tuned_knobs(device, extents, len(bank), src) if tuned else None
    if knobs:
        return str(knobs["engine"])
    digits = len(digit_types(src, mode, cval))
    if (
        tensor_pays(len(bank), extents, digits)
        and tensor_refusal(device, bank, src, mode, cval, split=digits > 1) is None
    ):
        return "tensor"
    return "fp32"


def tensor_convolver(
    kernels: object,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    mode: str = "reflect",
    cval: float = 0.0,
    *,
    device: cl.Device,
    **overrides: object,
) -> BankConvolver:
    """The tensor-core engine as `volconv.engines.registry.ENGINES` offers it to
    `volconv.plan.tune`: `TensorConvolver` or `DigitConvolver` by the volume's type; a
    ValueError where the device or bank refuse it (`tensor_refusal`). Its error is below the
    FP32 kernel's at every extent (exact int32 sums), so the tuner may take it wherever it is
    faster."""
    bank = as_kernel_bank(kernels)
    overrides.pop("engine", None)
    return direct_convolver(bank, shape, dtype, mode, cval, device=device, engine="tensor",
                            **overrides)  # fmt: skip

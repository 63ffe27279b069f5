"""The tensor-core engine for volumes 8-bit integers do not hold exactly (16-bit integers,
float32 and wider, a non-integer ``cval`` in constant mode): `DigitConvolver` splits the padded
slab on the device into 8-bit digit slabs (kernels/digits.cl), filters each through
`volconv.engines.tensor.TensorConvolver`'s kernel and sums the responses in FP32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields

import numpy as np
import pyopencl as cl

from volconv.device.devices import select_device
from volconv.device.programs import build
from volconv.engines.direct import BankConvolver, as_kernel_bank
from volconv.engines.padder import native_volume
from volconv.engines.tensor import (
    EXACT_TYPES,
    TENSOR_ENGINE,
    TensorConvolver,
    TensorShape,
    tensor_refusal,
)
from volconv.plan.direct import (
    CL_TYPES,
    Plan,
    _deepest_slab,
    pad_dtype_for,
    streaming_depth,
)

# The digits of a float slab's fixed point (8 bits each): with 3, q = rint(x / 2^s) is a 24-bit
# number, its rounding below 2^-23 of the slab's largest |x|, float32's own spacing there.
FLOAT_DIGITS = 3
REDUCE_GROUP = 256  # work-items per group of digits.cl's slab_max (a power of two)
REDUCE_GROUPS = 1024


def digit_types(dtype: np.dtype, mode: str = "reflect", cval: float = 0.0) -> tuple[np.dtype, ...]:
    """The 8-bit slabs, top digit first, a padded slab of volumes of ``dtype`` splits into
    for the tensor cores: itself where it is 8-bit (`EXACT_TYPES`, cval one of its values);
    int16 into int8 and uint8 (x = 256 hi + lo), uint16 into two uint8; a float slab (or a
    cval off the integer type) into a signed fixed point of `FLOAT_DIGITS` digits, int8 then
    uint8."""
    src = native_volume(np.empty(0, dtype)).dtype
    pad = pad_dtype_for(src, mode, cval)
    u8, i8 = EXACT_TYPES
    if pad in EXACT_TYPES:
        return (pad,)
    if pad == np.int16:
        return (i8, u8)
    if pad == np.uint16:
        return (u8, u8)
    return (i8, *[u8] * (FLOAT_DIGITS - 1))


def _plan_fields(plan: Plan) -> dict[str, object]:
    """What makes ``plan`` as a `Plan`: its fields given to the constructor."""
    return {f.name: getattr(plan, f.name) for f in dataclass_fields(Plan) if f.init}


@dataclass(frozen=True)
class DigitPlan(Plan):
    """A `DigitConvolver`'s plan: `Plan`'s buffers and the digits' (`slab_bytes`), so that
    ``device_bytes`` is what it holds and a memory budget plans its slab honestly."""

    digits: tuple[np.dtype, ...] = ()

    @classmethod
    def of(cls, plan: Plan, digits: tuple[np.dtype, ...]) -> DigitPlan:
        return cls(**_plan_fields(plan), digits=tuple(digits))

    def digit_plan(self, dt: np.dtype) -> Plan:
        """The plan of digit type ``dt``'s `TensorConvolver`: its padded slab is the digit
        slab (cval 0: the split pads already)."""
        return Plan(**{**_plan_fields(self), "src_dtype": dt, "pad_dtype": dt, "cval": 0.0})

    def slab_bytes(self, depth: int) -> dict[str, int]:
        """Device bytes of each buffer for a slab of ``depth`` output rows: the padded slab's
        and the responses' (`Plan`), a second response buffer the digits' sums read, and
        each digit type's slab (its padder's rows, never filled, and its padded slab)."""
        sizes = super().slab_bytes(depth)
        sizes["part"] = sizes["responses"]
        for dt in dict.fromkeys(self.digits):
            inner = self.digit_plan(dt).slab_bytes(depth)
            sizes[f"{dt} source"], sizes[f"{dt} padded"] = inner["source"], inner["padded"]
        return sizes


class DigitConvolver(BankConvolver):
    """The tensor-core engine for volumes 8-bit integers do not hold exactly (`digit_types`):
    `BankConvolver`'s parameters, slabs and results.

    Each slab is padded in its own type (a float slab in float32), split on the device into
    8-bit digit slabs (kernels/digits.cl: a float slab first scaled by the power of two that
    puts its largest |x| at the top of a `FLOAT_DIGITS` x 8-bit fixed point), and each digit
    slab filtered by a `TensorConvolver` of its type; the responses are summed top digit
    first, ``out = 256 out + part`` in FP32, then scaled back. 16-bit integers are exact
    digits; floats round once, to the fixed point. NaN and Inf voxels are set as in scipy by
    `BankConvolver`'s override, the slab's finite part filtered here. The ``kernel`` timing
    counts the split and the sums beside the digits' launches.

    Parameters
    ----------
    shape_split, emulate
        As `TensorConvolver`'s, for each digit's.
    **kwargs
        As `BankConvolver`'s. The plan is a `DigitPlan`: without ``slab_depth`` the slab is
        the deepest whose buffers, the digits' included, fit the memory budget.
    """

    plan_defaults = TensorConvolver.plan_defaults  # each digit slab goes through its kernel

    def __init__(
        self,
        kernels: object,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str = "reflect",
        cval: float = 0.0,
        *,
        shape_split: TensorShape | None = None,
        emulate: bool = False,
        **kwargs: object,
    ) -> None:
        self.digits = digit_types(dtype, mode, cval)
        if len(self.digits) == 1:
            raise ValueError(f"{np.dtype(dtype)} slabs are 8-bit already: use TensorConvolver")
        self.engine = f"{TENSOR_ENGINE}x{len(self.digits)}"  # the record's name: digits
        self.emulate = emulate
        self._inner_options = {"shape_split": shape_split, "emulate": emulate}
        device = kwargs.pop("device", None)
        device = device if isinstance(device, cl.Device) else select_device(device)
        plan = kwargs.pop("plan", None)
        if plan is None:
            plan = self.plan_for(as_kernel_bank(kernels), shape, dtype, mode, cval, device,
                                 **kwargs)  # fmt: skip
        elif not isinstance(plan, DigitPlan):
            plan = DigitPlan.of(plan, self.digits)
        super().__init__(kernels, shape, dtype, mode, cval, device=device, plan=plan)

    @classmethod
    def plan_for(
        cls,
        bank: np.ndarray,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str,
        cval: float,
        device: cl.Device,
        **overrides: object,
    ) -> DigitPlan:
        """The `DigitPlan` of ``bank`` (`BankConvolver.plan_for` with `TensorConvolver`'s
        defaults: the slab in its own type, split exactly), and without ``slab_depth`` the
        deepest slab whose buffers, the digits' included, fit the budget."""
        depth, budget = overrides.pop("slab_depth", None), overrides.pop("memory_budget", None)
        stream = overrides.pop("stream", False)
        plan = DigitPlan.of(
            super().plan_for(bank, shape, dtype, mode, cval, device, slab_depth=depth or 1,
                             **overrides),
            digit_types(dtype, mode, cval),
        )  # fmt: skip
        if depth is None:
            depth = _deepest_slab(plan, device, budget)  # with the digits' buffers
            if stream:
                depth = min(depth, streaming_depth(plan.shape[0], math.prod(plan.shape[1:])))
            plan = replace(plan, slab_depth=depth)
        return plan

    def _build_passes(self) -> None:
        plan, ctx = self.plan, self.ctx
        reason = tensor_refusal(self.device, self.kernels, plan.src_dtype, plan.mode, plan.cval,
                                split=True)  # fmt: skip
        if reason and not (self.emulate and "mma.sync" in reason):
            raise ValueError(f"the tensor-core engine does not take this bank: {reason}")
        self.fixed_point = plan.pad_dtype.kind == "f"
        defines = {"SRC_T": CL_TYPES[plan.pad_dtype], "DIGITS": len(self.digits)}
        if self.fixed_point:
            defines["FIXED_POINT"] = 1
        program = build(ctx, "digits.cl", tuple(defines.items()))
        self._split, self._combine, self._max = (
            cl.Kernel(program, name) for name in ("split", "combine", "slab_max")
        )
        # one TensorConvolver per digit type, planned as this slab: its padded buffer is the
        # digit slab; its responses go where `_launch_passes` points them
        self._inner = {}
        for dt in dict.fromkeys(self.digits):
            inner = TensorConvolver(self.kernels, plan.shape, dt, plan.mode, 0.0,
                                    device=self.device, plan=plan.digit_plan(dt),
                                    **self._inner_options)  # fmt: skip
            inner._out = None  # its own response buffer is never used
            self._inner[dt] = inner
        mf = cl.mem_flags
        self._part = cl.Buffer(ctx, mf.READ_WRITE, plan.slab_bytes(plan.slab_depth)["part"])
        self._max_bits = cl.Buffer(ctx, mf.READ_WRITE, 4)

    def _launch_passes(self, depth: int) -> list[cl.Event]:
        """Split the padded slab of ``depth`` output rows into digits, filter each, sum."""
        plan, queue = self.plan, self.queue
        p1, p2 = plan.padded_yz
        n = np.int64((depth + plan.extents[0] - 1) * p1 * p2)
        size = plan.n_filters * depth * math.prod(plan.shape[1:])
        events = []
        if self.fixed_point:
            events.append(cl.enqueue_fill_buffer(queue, self._max_bits, np.uint32(0), 0, 4))
            group = min(REDUCE_GROUP, self.device.max_work_group_size)
            groups = min(REDUCE_GROUPS, -(-int(n) // group))
            self._max.set_args(self._padded, n, self._max_bits, cl.LocalMemory(4 * group))
            events.append(cl.enqueue_nd_range_kernel(queue, self._max, (group * groups,),
                                                     (group,)))  # fmt: skip
        last = len(self.digits) - 1
        for d, dt in enumerate(self.digits):
            inner = self._inner[dt]
            self._split.set_args(self._padded, inner._padded, n, np.int32(8 * (last - d)),
                                 self._max_bits)  # fmt: skip
            events.append(cl.enqueue_nd_range_kernel(queue, self._split, (int(n),), None))
            inner._out = self._out if d == 0 else self._part
            events += inner._launch_passes(depth)
            if d:
                self._combine.set_args(self._out, self._part, np.int64(size),
                                       np.int32(d == last), self._max_bits)  # fmt: skip
                events.append(cl.enqueue_nd_range_kernel(queue, self._combine, (size,), None))
        return events

    @property
    def tensor_gflop(self) -> float:
        """GFLOP the tensor cores execute for one volume: every digit's (`TensorConvolver`)."""
        return sum(self._inner[dt].tensor_gflop for dt in self.digits)

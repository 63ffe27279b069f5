"""Plan a bank convolution once from device limits: passes, outputs per work-item (unroll
along z, rows along y), work-group, slab depth.

Everything the kernel needs at compile time (extents, vector width, unroll, element type) and
every size the host allocates is fixed here, so the engine only launches. Tests and benchmarks
override any knob; otherwise the knobs `volconv bench --tune` cached for this device, driver
and bank shape (`volconv.plan.knobs.tuned_knobs`), else the defaults, which come from
measurements (benchmarks/README.md). `volconv.engines.registry.ENGINES` names the engines a plan
may choose between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pyopencl as cl

from volconv.engines.boundary import halo
from volconv.engines.registry import ENGINES
from volconv.plan.knobs import (
    MAX_ROWS,
    MAX_UNROLL,
    VECTOR_WIDTHS,
    check_knobs,
    ignored_entry,
    tune_keys,
    tune_path,
    tuned_knobs,
)

MAX_FILTERS = 64
# Generated filters the separable path runs as 1D passes may be wider than the direct kernel's
# volconv.bank.spec.MAX_EXTENT (a Gaussian of sigma 16 at truncate 4 is 129 taps).
MAX_SEPARABLE_EXTENT = 257
# ... and a bank with derived features may run more filters than the direct kernel's floatN
# accumulators hold (ilastik's preset at its seven default scales runs 84): the passes keep
# one plane per response, the direct groups stay at MAX_FILTERS each.
MAX_SEPARABLE_FILTERS = 256
MAX_Z_POSITIONS = 64  # bank_conv.cl expands MADS(0..63): KZ + UNROLL - 1 must fit

# The defaults below were measured on an H100 and PoCL: benchmarks/README.md, "The measurements
# behind the defaults", holds the figures and their result files.
# Fraction of the FMA probe one pass of each vector width reaches at its own block (`Block`):
# passes are chosen by cost = width / efficiency.
PASS_EFFICIENCY = {1: 0.638, 2: 0.680, 4: 0.684, 8: 0.749, 16: 0.60}
# CPUs: a pass of width 4 costs what a pass of 8 costs.
PASS_EFFICIENCY_CPU = {1: 0.24, 2: 0.25, 4: 0.47, 8: 0.88, 16: 0.88}
# GPUs: outputs per work-item along z (unroll) and y (rows) by vector width: narrow vectors
# need the 2D block to reuse each value enough; wider ones spill at more unroll.
DEFAULT_UNROLL = {1: 8, 2: 4, 4: 4, 8: 8, 16: 2}
DEFAULT_ROWS = {1: 4, 2: 4, 4: 2, 8: 1, 16: 2}
# With rows > 1 the kernel unrolls its loop over input rows whole; past this many FMA
# instructions per filter plane the code outgrows the instruction cache, and width 1 rolls
# its loop over filter rows (bank_conv.cl's ROLL).
MAX_UNROLLED_FMAS = 1600
ROLL_MAX_WIDTH = 1
DEFAULT_UNROLL_1D = {1: 16, 2: 16, 4: 16, 8: 8, 16: 4}
# GPUs, rows 1 at width 8 or more: how the loop over rows runs, by kz.
GPU_ROW_UNROLL = 2
GPU_ROW_UNROLL_MAX_KZ = 7
GPU_ROLL_MAX_KZ = 3
# GPUs: the work-group stages its input planes in local memory as floats (bank_conv.cl's
# INPUT_LOCAL) for passes of these widths whose block has this unroll, from this kz on, where
# two tiles fit.
INPUT_LOCAL_WIDTHS: tuple[int, ...] = (2, 4)
INPUT_LOCAL_UNROLL = 4
INPUT_LOCAL_MIN_KZ = 7
# CPUs (PoCL) have no register file to spill from: deep unrolls.
DEFAULT_UNROLL_CPU = {1: 16, 2: 16, 4: 16, 8: 16, 16: 8}
DEFAULT_ROWS_CPU = {1: 1, 2: 1, 4: 1, 8: 1, 16: 1}

# Slabs per frame a streamed run aims for: with one slab nothing overlaps (read, then compute,
# then write); with several, reading slab i + 1, computing slab i and writing slab i - 1 run
# at once. Smaller slabs cost the halo rows read twice and more launches, transfers and host
# work between them: below MIN_STREAM_VOXELS (128^3) a frame is one slab, whose launches keep
# a CPU's cores evenly busy (benchmarks/README.md, "Features").
STREAM_SLABS = 4
MIN_STREAM_DEPTH = 32
MIN_STREAM_VOXELS = 1 << 21


def streaming_depth(rows: int, plane: int) -> int:
    """The deepest slab a streamed run of ``rows`` rows of ``plane`` voxels per frame takes."""
    return max(MIN_STREAM_DEPTH, math.ceil(rows / STREAM_SLABS), -(-MIN_STREAM_VOXELS // plane))


# Element types the kernels read natively; anything else is converted to float32 on the host.
CL_TYPES = {
    np.dtype(np.uint8): "uchar",
    np.dtype(np.int8): "char",
    np.dtype(np.uint16): "ushort",
    np.dtype(np.int16): "short",
    np.dtype(np.float32): "float",
}


@dataclass(frozen=True)
class Block:
    """One pass's register block and work-group: outputs per work-item along z (``unroll``)
    and y (``rows``), the unroll of the loop over rows (None: the compiler's choice, 0: whole)
    and its order (``roll``: over filter rows with a window of input rows in registers);
    ``input_local``: how many tiles of its input planes the work-group stages in local memory
    as floats (bank_conv.cl's INPUT_LOCAL; 0: none, rows read from global memory)."""

    unroll: int
    rows: int
    row_unroll: int | None
    roll: bool
    local_size: tuple[int, int, int]
    input_local: int = 0


@dataclass(frozen=True)
class Pass:
    """One launch of bank_conv: filters ``first .. first + count`` in a vector of ``width``;
    ``block`` None: the plan's (`Plan.block`)."""

    first: int
    count: int
    width: int
    block: Block | None = None


@dataclass(frozen=True)
class Plan:
    """Every compile-time constant and size of one bank convolution."""

    shape: tuple[int, int, int]
    extents: tuple[int, int, int]
    n_filters: int
    mode: str
    cval: float
    src_dtype: np.dtype
    pad_dtype: np.dtype
    passes: tuple[Pass, ...]
    unroll: int
    local_size: tuple[int, int, int]
    slab_depth: int
    filt_local: bool
    rows: int = 1
    row_unroll: int | None = None
    roll: bool = False
    input_local: int = 0
    engine: str = ENGINES[0].name
    halo_lo: tuple[int, int, int] = field(init=False)
    halo_hi: tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        lo, hi = zip(*(halo(k) for k in self.extents), strict=True)
        object.__setattr__(self, "halo_lo", tuple(lo))
        object.__setattr__(self, "halo_hi", tuple(hi))

    def block(self, p: Pass | None = None) -> Block:
        """The register block and work-group of pass ``p`` (default: the plan's own, which
        every pass without one of its own takes)."""
        if p is not None and p.block is not None:
            return p.block
        return Block(self.unroll, self.rows, self.row_unroll, self.roll, self.local_size,
                     self.input_local)  # fmt: skip

    @property
    def padded_yz(self) -> tuple[int, int]:
        """(P1, P2) of the padded slab; P2 covers every pass's last work-item's unrolled
        reads, a multiple of 4 where a pass stages input tiles (read 4 values a load) and for
        the tensor engine (its rows read as aligned 32-bit words)."""
        ny, nz = self.shape[1:]
        ky, kz = self.extents[1:]
        blocks = [self.block(p) for p in self.passes] + [self.block()]
        p2 = max(math.ceil(nz / b.unroll) * b.unroll for b in blocks) + kz - 1
        if self.engine == "tensor" or any(b.input_local for b in blocks):
            p2 = -(-p2 // 4) * 4
        return ny + ky - 1, p2

    @property
    def n_slabs(self) -> int:
        return math.ceil(self.shape[0] / self.slab_depth)

    def slab_bytes(self, depth: int) -> dict[str, int]:
        """Device bytes of each buffer for a slab of ``depth`` output rows."""
        ny, nz = self.shape[1:]
        p1, p2 = self.padded_yz
        rows = depth + self.extents[0] - 1
        return {
            "source": rows * ny * nz * self.src_dtype.itemsize,
            "padded": rows * p1 * p2 * self.pad_dtype.itemsize,
            "responses": self.n_filters * depth * ny * nz * 4,
        }

    @property
    def device_bytes(self) -> int:
        return sum(self.slab_bytes(self.slab_depth).values())

    def build_options(self, p: Pass) -> dict[str, object]:
        """bank_conv.cl's defines for pass ``p``."""
        b = self.block(p)
        return {
            "KX": self.extents[0], "KY": self.extents[1], "KZ": self.extents[2],
            "NV": p.width, "UNROLL": b.unroll, "IN_T": CL_TYPES[self.pad_dtype],
            "FILT_LOCAL": int(self.filt_local), "ROWS": b.rows,
            **({} if b.row_unroll is None else {"ROW_UNROLL": b.row_unroll}),
            **({"ROLL": 1} if b.roll else {}),
            **({"INPUT_LOCAL": b.input_local, "LZ": b.local_size[0], "LY": b.local_size[1]}
               if b.input_local else {}),
        }  # fmt: skip


def tile_bytes(
    unroll: int, rows: int, local_size: tuple[int, ...], extents: tuple[int, int, int]
) -> int:
    """Local memory of one of bank_conv.cl's input tiles (INPUT_LOCAL; its TR, NQ, PART,
    RS)."""
    lz, ly = local_size[:2]
    ky, kz = extents[1:]
    split = unroll // 4
    chunks = -(-(lz * unroll + kz - 1) // 4)
    part = -(-chunks // split)
    if split > 1 and 8 % split == 0:
        part += (8 // split - part % 8) % 8
    return (ly * rows + ky - 1) * split * part * 16


def split_passes(
    n: int, width: int | None = None, efficiency: dict[int, float] = PASS_EFFICIENCY
) -> tuple[Pass, ...]:
    """Cheapest sequence of vector passes covering ``n`` filters (or all of one ``width``),
    a pass of width w costing w / ``efficiency[w]``."""
    widths = (width,) if width else VECTOR_WIDTHS
    cost = [0.0] + [math.inf] * n
    choice = [0] * (n + 1)
    for m in range(1, n + 1):
        for w in widths:
            c = cost[max(0, m - w)] + w / efficiency[w]
            if c < cost[m]:
                cost[m], choice[m] = c, w
    passes, m = [], n
    while m > 0:
        w = choice[m]
        passes.append(w)
        m = max(0, m - w)
    out, first = [], 0
    for w in sorted(passes, reverse=True):
        count = min(w, n - first)
        out.append(Pass(first, count, w))
        first += count
    return tuple(out)


def pad_dtype_for(src: np.dtype, mode: str, cval: float, *, pad_float: bool = False) -> np.dtype:
    """The padded slab keeps the source type unless cval does not fit in it, or float32 is
    asked for (``pad_float``)."""
    if pad_float:
        return np.dtype(np.float32)
    if mode == "constant" and src.kind in "iu":
        info = np.iinfo(src)
        if not (float(cval).is_integer() and info.min <= cval <= info.max):
            return np.dtype(np.float32)
    return src


def make_plan(
    shape: tuple[int, int, int],
    src_dtype: np.dtype,
    extents: tuple[int, int, int],
    n_filters: int,
    mode: str,
    cval: float,
    device: cl.Device,
    *,
    slab_depth: int | None = None,
    memory_budget: int | None = None,
    unroll: int | None = None,
    vector_width: int | None = None,
    local_size: tuple[int, int] | None = None,
    rows: int | None = None,
    input_local: bool | None = None,
    engine: str | None = None,
    pad_float: bool | None = None,
    tuned: bool = True,
    stream: bool = False,
) -> Plan:
    """Plan from the device's limits; keyword arguments override the choices (tests, bench).

    ``unroll``, ``rows``, ``vector_width``, ``local_size``, ``input_local`` and ``engine`` not
    given come from the tuning cache when it holds this device, driver and bank shape
    (`tuned_knobs`; ``tuned`` False skips it), else from the defaults per kind of device; then
    every pass takes the plan's block (`Block`), and untuned each pass narrower than the
    widest its own width's. ``input_local`` True stages every pass's input planes in local
    memory, two tiles where they fit, else one (a ValueError where a pass's unroll is not a
    multiple of 4 or no tile fits the device's local memory); default: on GPUs for passes of
    `INPUT_LOCAL_WIDTHS` at `INPUT_LOCAL_UNROLL` from `INPUT_LOCAL_MIN_KZ` on, where two
    tiles fit. ``pad_float`` pads the slab as float32 whatever the source type (default: on
    CPUs, whose kernel then broadcasts each input straight from memory, with no conversion in
    the hot loop).

    ``stream`` asks for slabs shallow enough that reading, computing and writing overlap
    (`STREAM_SLABS` per frame, at least `MIN_STREAM_DEPTH` rows and `MIN_STREAM_VOXELS`
    voxels), as a pipeline run wants;
    the whole-array API takes the deepest slab that fits.
    """
    check_knobs(device, unroll, vector_width, local_size, rows)
    given = {"unroll": unroll, "vector_width": vector_width, "local_size": local_size,
             "rows": rows, "input_local": input_local, "engine": engine}  # fmt: skip
    kz = extents[2]
    cpu = bool(device.type & cl.device_type.CPU)
    knobs = {}
    if tuned and isinstance(device, cl.Device) and None in (unroll, rows, vector_width,
                                                            local_size, engine):  # fmt: skip
        knobs = tuned_knobs(device, extents, n_filters, src_dtype) or {}
    vector_width = knobs.get("vector_width") if vector_width is None else vector_width
    local_size = knobs.get("local_size") if local_size is None else local_size
    engine = knobs.get("engine", ENGINES[0].name) if engine is None else engine
    input_local = knobs.get("input_local") if input_local is None else input_local
    passes = split_passes(n_filters, vector_width, PASS_EFFICIENCY_CPU if cpu else PASS_EFFICIENCY)
    widest = max(p.width for p in passes)
    unroll = unroll or knobs.get("unroll")
    rows = rows or knobs.get("rows")
    try:
        block = _block(widest, shape, extents, device, unroll, rows, local_size, input_local)
    except ValueError as e:
        if not knobs:
            raise
        # the tuning's entry does not fit this device: the cache's fault, not the input's
        bank_key = tune_keys(device, extents, n_filters, src_dtype)[1]
        ignored_entry(tune_path(), f"its entry for {bank_key} does not fit {device.name.strip()} "
                              f"({e})")  # fmt: skip
        return make_plan(shape, src_dtype, extents, n_filters, mode, cval, device,
                         slab_depth=slab_depth, memory_budget=memory_budget, pad_float=pad_float,
                         tuned=False, stream=stream, **given)  # fmt: skip
    if (unroll, rows, local_size) == (None, None, None):
        # untuned: each narrower pass takes its own width's block
        own = [_block(p.width, shape, extents, device, input_local=input_local)
               for p in passes]  # fmt: skip
        passes = tuple(replace(p, block=None if b == block else b)
                       for p, b in zip(passes, own, strict=True))  # fmt: skip
    taps = extents[0] * extents[1] * kz
    filt_local = taps * widest * 4 <= device.local_mem_size // 2

    plan = Plan(
        shape=shape, extents=extents, n_filters=n_filters, mode=mode, cval=float(cval),
        src_dtype=src_dtype, passes=passes, unroll=block.unroll, local_size=block.local_size,
        rows=block.rows, row_unroll=block.row_unroll, roll=block.roll,
        input_local=block.input_local,
        pad_dtype=pad_dtype_for(src_dtype, mode, cval, pad_float=cpu if pad_float is None
                                else pad_float),
        slab_depth=shape[0], filt_local=filt_local, engine=engine,
    )  # fmt: skip
    if slab_depth is None:
        slab_depth = _deepest_slab(plan, device, memory_budget)
        if stream:
            slab_depth = min(slab_depth, streaming_depth(shape[0], shape[1] * shape[2]))
    slab_depth = max(1, min(int(slab_depth), shape[0]))
    return replace(plan, slab_depth=slab_depth)


def _block(
    width: int,
    shape: tuple[int, int, int],
    extents: tuple[int, int, int],
    device: cl.Device,
    unroll: int | None = None,
    rows: int | None = None,
    local_size: tuple[int, int] | None = None,
    input_local: bool | None = None,
) -> Block:
    """The register block and work-group of a pass of ``width``: the knobs given, the rest
    from the defaults per kind of device."""
    cpu = bool(device.type & cl.device_type.CPU)
    ky, kz = extents[1:]
    nz = shape[2]
    unroll_given = unroll is not None
    unroll = unroll or (DEFAULT_UNROLL_CPU if cpu else DEFAULT_UNROLL)[width]
    rows_given = rows is not None
    rows = rows or (DEFAULT_ROWS_CPU if cpu else DEFAULT_ROWS)[width]
    if not unroll_given:
        unroll = min(unroll, 1 << max(0, math.ceil(math.log2(nz))))
    unroll = max(1, min(unroll, MAX_UNROLL, MAX_Z_POSITIONS + 1 - kz))
    rows = max(1, min(rows, MAX_ROWS, shape[1]))
    roll, row_unroll = False, None
    if rows > 1 and rows * unroll * ky * kz * width > MAX_UNROLLED_FMAS:
        # the loop over input rows unrolled whole would outgrow the instruction cache: rows
        # given, and width 1 on GPUs, keep the block with the loop over filter rows
        if rows_given or (not cpu and width <= ROLL_MAX_WIDTH):
            roll, row_unroll = True, rows
        else:
            while rows > 1 and rows * unroll * ky * kz * width > MAX_UNROLLED_FMAS:
                rows //= 2
            if rows == 1 and not unroll_given:
                unroll = min(DEFAULT_UNROLL_1D[width], MAX_Z_POSITIONS + 1 - kz)
                unroll = min(unroll, 1 << max(0, math.ceil(math.log2(nz))))
    elif not cpu and rows == 1 and width >= 8 and kz <= GPU_ROLL_MAX_KZ:
        roll, row_unroll = True, 1
    elif not cpu and rows == 1 and width >= 8 and kz <= GPU_ROW_UNROLL_MAX_KZ:
        row_unroll = GPU_ROW_UNROLL
    if local_size is None:
        # 128 work-items, up to 32 along z: 32x4 at unroll 8 beat 16x8 on the H100 (74 % vs
        # 72 % of peak, benchmarks/results/h100-bench.json).
        lz = min(32, 1 << max(0, math.ceil(math.log2(math.ceil(nz / unroll)))))
        gy = math.ceil(shape[1] / rows)
        ly = max(1, min(128 // lz, 1 << max(0, math.ceil(math.log2(gy)))))
        local_size = (lz, ly)
    lz, ly = local_size
    while lz * ly > device.max_work_group_size:
        ly, lz = (ly // 2, lz) if ly > 1 else (ly, lz // 2)
    # the input tiles beside the coefficients (staged in local memory where they take at
    # most half of it, `make_plan`)
    taps = math.prod(extents) * width * 4
    room = device.local_mem_size - (taps if taps <= device.local_mem_size // 2 else 0)
    need = tile_bytes(unroll, rows, (lz, ly), extents) if unroll % 4 == 0 else None
    tiles = 0 if need is None else min(2, room // need)
    if input_local is None:
        input_local = (not cpu and width in INPUT_LOCAL_WIDTHS and unroll == INPUT_LOCAL_UNROLL
                       and kz >= INPUT_LOCAL_MIN_KZ and tiles == 2)  # fmt: skip
    elif input_local and need is None:
        raise ValueError(f"input_local: needs an unroll that is a multiple of 4; a pass of "
                         f"width {width} has unroll {unroll}")  # fmt: skip
    elif input_local and not tiles:
        raise ValueError(f"input_local: the input tiles of a pass of width {width} at {unroll} "
                         f"x {rows}, work-group {lz}x{ly}, take {need} bytes of local memory; "
                         f"{device.name.strip()} has {room} beside the coefficients")  # fmt: skip
    return Block(unroll, rows, row_unroll, roll, (lz, ly, 1), tiles if input_local else 0)


def _deepest_slab(plan: Plan, device: cl.Device, memory_budget: int | None) -> int:
    """Deepest slab whose buffers fit the budget, each one allocation, and int indexing."""
    budget = memory_budget or min(device.global_mem_size // 4, 2 << 30)
    fixed = plan.slab_bytes(0)  # the halo rows every slab carries
    row = {k: v - fixed[k] for k, v in plan.slab_bytes(1).items()}  # each output row more
    per_row = sum(row.values())
    depth = (budget - sum(fixed.values())) // per_row
    for name, size in row.items():
        if size:
            depth = min(depth, (device.max_mem_alloc_size - fixed[name]) // size)
    p1, p2 = plan.padded_yz
    depth = min(depth, (2**31 - 1) // (p1 * p2) - plan.extents[0])
    if depth < 1:
        raise ValueError(
            f"memory_budget: {budget} bytes hold no slab of a {plan.shape} volume "
            f"with {plan.n_filters} filters (one output row needs {per_row} bytes)"
        )
    return int(min(depth, plan.shape[0]))

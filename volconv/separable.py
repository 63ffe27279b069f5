"""The separable path: a bank as 1D passes shared across its filters, each at its own extent.

`plan_bank` chooses per filter between the direct kernel and separable passes by a cost model
(`Choice`); `SeparableConvolver` has `BankConvolver`'s slab interface and computes every
response of the bank: the separable filters by 1D passes (kernels/separable.cl), the others by
direct convolvers grouped by their own extent, never padded to the widest.

The passes are exact in every boundary mode because the slab is first padded in 3D by
kernels/pad.cl with scipy's index maps (as `BankConvolver` pads it; a constant ``cval`` border
is then right for every filter), and every pass is a *valid* correlation with the flipped 1D
factor: along each axis, ``convolve`` reads ``k - 1 - k // 2`` samples before an output and
``k // 2`` after it, so a factor of extent ``k`` starts ``halo_lo - (k - 1 - k // 2)`` samples
into the bank's common halo. Equal factors are computed once: the passes form a tree, distinct
axis-2 factors -> distinct (axis-2, axis-1) pairs -> distinct terms, each term added with its
coefficient into every response that holds it, on the device before the download.

Non-finite voxels (NaN, +-Inf) are exact as in scipy, as on the direct path: the passes filter
the slab with them set to 0, and `volconv.nonfinite` sets the outputs they reach.

In a pipeline, `SeparableConvolver` takes `BankConvolver`'s place: give it the bank's `Filter`
list (not the zero-padded stack, which would lose each filter's own extent and its factors);
`plan` has ``slab_depth``, ``n_slabs``, ``device_bytes`` and ``choices`` (`describe_plan` prints
them); the throughput record takes `gflop`, `executed_gflop`, `kernel_bytes` and `engines`.
`make_separable_plan` plans without building, for ``volconv validate``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pyopencl as cl

from volconv.bank import Filter, stack_kernels
from volconv.boundary import extend_indices, halo
from volconv.checks import check_cval, check_mode
from volconv.device import select_device
from volconv.engine import (
    STAGES,
    BankConvolver,
    Padder,
    SlabConvolver,
    check_out,
    check_volume_dtype,
    frame_bytes,
    native_volume,
    slab_rows,
)
from volconv.factor import Term, factorise, reconstruction_ok
from volconv.nonfinite import NonFiniteOverride, finite_part, has_nonfinite
from volconv.plan import (
    CL_TYPES,
    MAX_EXTENT,
    MAX_FILTERS,
    make_plan,
    pad_dtype_for,
    streaming_depth,
)
from volconv.programs import build, context_for, device_seconds
from volconv.report import work_gflop

PATHS = ("direct", "separable", "low-rank")

# Cost model per output voxel, in units of one tap of the direct kernel: a 1D pass costs
# PASS_FIXED (reading and writing a float per output) plus PASS_PER_TAP a tap; only the ratios
# matter for the choice. Fitted by scripts/bench_separable.py (its "cost_model"), rounded:
#   CPUs: PoCL, 2-core EPYC, 128^3 uint8 (benchmarks/results/pocl-separable.json): a direct
#     tap 0.019 ns, a pass 0.37 ns at 3 taps .. 2.3-2.6 at 23-31 -> 12 + 3 per tap.
#   GPUs: H100, OpenCL (benchmarks/results/h100-separable.json): a direct tap 0.046 ps, a pass
#     6.4 ps + 0.69 ps per tap -> 140 + 15 per tap. The direct kernel runs near the FP32 peak
#     while the passes are bound by memory, so a GPU takes them for wider filters than a CPU.
#     Those passes ran at V = 16; at the GPU's own V = 2, U = 4 they are 2.9x faster (the
#     sweep above), so the GPU's constants are the fit divided by 2.9: 48 + 5.2 per tap.
PASS_COSTS = {"cpu": (12.0, 3.0), "gpu": (48.0, 5.2)}  # (PASS_FIXED, PASS_PER_TAP)
MAX_TERMS = 8  # longest decomposition worth trying for a custom kernel

# Outputs per work-item of the passes along axis 2 (the vector width V) and along axis 0 in
# pass_out (rows U), per kind of device. CPUs (PoCL): V = 16 beat 8 by 20 %, U = 4 beat 1, 2
# and 8. GPUs (H100, benchmarks/results/h100-separable-sweep.json): V = 2, U = 4 ran the
# ilastik bank in 8.9 ms against 25.5 ms at V = 16 (wide vectors do not coalesce there).
PASS_SHAPE = {"cpu": (16, 4), "gpu": (2, 4)}  # (V, U)
MID_ROWS = 2  # ... and along axis 1 in pass_mid (1 and 4 were no faster on PoCL)
BLOCK_ROWS = 0  # rows the tree runs over at a time; 0: the slab (blocks of 8..64: slower)


@dataclass(frozen=True)
class Choice:
    """How one filter is computed.

    Attributes
    ----------
    path : {'direct', 'separable', 'low-rank'}
        'separable': the filter's own factors (a generated filter); 'low-rank': terms found by
        `volconv.factor.factorise` for a custom kernel; 'direct': the k^3 kernel.
    extent : 3 ints
        The filter's own extent.
    terms : tuple of Term, or None
        The separable terms of the chosen path (None on the direct path).
    direct_cost, separable_cost : float
        The cost model's estimate per output voxel, in direct taps (separable: inf when the
        filter has no acceptable decomposition); each term counted alone, without sharing.
    """

    path: str
    extent: tuple[int, int, int]
    terms: tuple[Term, ...] | None
    direct_cost: float
    separable_cost: float

    def describe(self) -> str:
        taps = math.prod(self.extent)
        ext = "x".join(map(str, self.extent))
        if self.path == "direct":
            why = (
                "no decomposition within tolerance cheaper than direct"
                if math.isinf(self.separable_cost)
                else f"separable would cost {self.separable_cost:.0f}"
            )
            return f"direct {ext} ({taps} taps; {why})"
        n = len(self.terms)
        return (
            f"{self.path} {ext}: {n} term{'s' * (n != 1)}, cost {self.separable_cost:.0f} "
            f"vs direct {self.direct_cost:.0f}"
        )


def separable_cost(terms: Sequence[Term], kind: str = "cpu") -> float:
    """Cost per output voxel of the terms' passes on a ``kind`` of device ('cpu' or 'gpu'),
    unshared, in direct taps."""
    fixed, per_tap = PASS_COSTS[kind]
    return sum(3 * fixed + per_tap * sum(t.extent) for t in terms)


def _entries(filters: object) -> list[tuple[np.ndarray, tuple[Term, ...] | None]]:
    """(kernel, known terms) per filter: from `Filter`s, an (N, kx, ky, kz) array or a list of
    3D arrays of any extents."""
    if isinstance(filters, np.ndarray):
        items = list(filters) if filters.ndim == 4 else [filters]
    else:
        items = list(filters)
    if not 1 <= len(items) <= MAX_FILTERS:
        raise ValueError(f"filters: N must be 1..{MAX_FILTERS}; got {len(items)}")
    out = []
    for i, item in enumerate(items):
        terms = item.factors if isinstance(item, Filter) else None
        k = np.asarray(item.kernel if isinstance(item, Filter) else item)
        if k.dtype.kind not in "biuf":
            raise TypeError(f"filter {i}: kernel must be real numbers; got dtype {k.dtype}")
        if k.ndim != 3 or not all(1 <= e <= MAX_EXTENT for e in k.shape):
            raise ValueError(
                f"filter {i}: kernel must be 3D with extents 1..{MAX_EXTENT}; got {k.shape}"
            )
        if not np.all(np.isfinite(k)):
            raise ValueError(f"filter {i}: kernel must be finite (no NaN or inf)")
        out.append((k.astype(np.float64), terms))
    return out


def device_kind(device: cl.Device) -> str:
    """'gpu' or 'cpu': which cost model fits ``device`` (accelerators count as GPUs)."""
    return "cpu" if device.type & cl.device_type.CPU else "gpu"


def plan_bank(filters: object, force: str | None = None, kind: str = "cpu") -> list[Choice]:
    """The path of each filter of a bank, by the cost model.

    Parameters
    ----------
    filters : list of Filter, (N, kx, ky, kz) array or list of 3D arrays
        Generated filters bring their factors; other kernels are tested for low rank when
        enough terms to pay off could exist.
    force : {'direct', 'separable'}, optional
        Override the cost model (tests, benchmarks): 'separable' takes every filter that has an
        acceptable decomposition to the passes, 'direct' none.
    kind : {'cpu', 'gpu'}
        The device's kind (`device_kind`): its cost model.
    """
    if force not in (None, "direct", "separable"):
        raise ValueError(f"force must be None, 'direct' or 'separable'; got {force!r}")
    choices = []
    for kernel, known in _entries(filters):
        extent = tuple(kernel.shape)
        direct = float(math.prod(extent))
        per_term = separable_cost([Term(1.0, tuple(np.empty(e) for e in extent))], kind)
        terms, path = known, "separable"
        if terms is not None and not reconstruction_ok(kernel, terms):
            terms = None  # e.g. a DoG of two close sigmas: its terms cancel too much
        if terms is None and force != "direct":
            affordable = MAX_TERMS if force == "separable" else int(direct // per_term)
            terms = factorise(kernel, min(MAX_TERMS, affordable)) if affordable else None
            if terms is not None and len(terms) > 1:
                path = "low-rank"
        cost = separable_cost(terms, kind) if terms else math.inf
        take = terms is not None and (force == "separable" or (force is None and cost < direct))
        choices.append(Choice(path if take else "direct", extent, terms, direct, cost))
    return choices


def describe_plan(choices: Sequence[Choice], names: Sequence[str] | None = None) -> str:
    """One line per filter, as `volconv validate` prints the plan."""
    names = names or [f"filter {i}" for i in range(len(choices))]
    width = max(len(n) for n in names)
    counts = {p: sum(c.path == p for c in choices) for p in PATHS}
    head = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
    lines = [f"paths: {head}"]
    lines += [f"  {n:<{width}}  {c.describe()}" for n, c in zip(names, choices, strict=True)]
    return "\n".join(lines)


# -- the pass tree -----------------------------------------------------------------------


@dataclass
class _Node:
    """One 1D pass: its flipped taps (a weights buffer) and the passes that read its output.

    ``off`` is where its taps start inside the common halo; ``lo`` and ``extra`` bound the
    rows (axis 0; for the roots also axis 1) its output is needed on: ``[lo, lo + n + extra)``.
    """

    k: int
    off: int
    taps: np.ndarray
    children: dict = field(default_factory=dict)
    targets: list = field(default_factory=list)  # leaves: (slot, coef)
    lo: int = 0
    extra: int = 0
    y_lo: int = 0  # roots: rows along axis 1, [y_lo, y_lo + ny + y_n)
    y_n: int = 0
    buf: cl.Buffer | None = None
    target_buf: cl.Buffer | None = None
    coef_buf: cl.Buffer | None = None


def _key(a: np.ndarray) -> tuple[int, bytes]:
    return len(a), np.ascontiguousarray(a[::-1], np.float32).tobytes()


@dataclass(frozen=True)
class SeparablePlan:
    """Sizes of one separable bank convolution (the direct groups plan their own)."""

    shape: tuple[int, int, int]
    n_filters: int
    mode: str
    cval: float
    src_dtype: np.dtype
    pad_dtype: np.dtype
    halo_lo: tuple[int, int, int]
    halo_hi: tuple[int, int, int]
    vector_width: int
    rows: int
    block_rows: int  # output rows the pass tree runs over at a time (0: the whole slab)
    slab_depth: int
    choices: tuple[Choice, ...]
    groups: tuple[tuple[int, ...], ...]  # direct filters, by extent
    direct_bytes: tuple[tuple[int, int], ...]  # per group: (fixed, per output row)

    @property
    def extents(self) -> tuple[int, int, int]:
        """The common extent that covers every filter's halo."""
        return tuple(lo + hi + 1 for lo, hi in zip(self.halo_lo, self.halo_hi, strict=True))

    @property
    def row(self) -> int:
        """R: elements of an intermediate row along axis 2 (a multiple of the vector width)."""
        return -(-self.shape[2] // self.vector_width) * self.vector_width

    @property
    def padded_yz(self) -> tuple[int, int]:
        ny = self.shape[1]
        return ny + self.halo_lo[1] + self.halo_hi[1], self.row + self.halo_lo[2] + self.halo_hi[2]

    @property
    def n_slabs(self) -> int:
        return math.ceil(self.shape[0] / self.slab_depth)

    @property
    def n_separable(self) -> int:
        return sum(c.path != "direct" for c in self.choices)

    @property
    def device_bytes(self) -> int:
        """Device memory of every buffer, the direct groups' included."""
        d = self.slab_depth
        direct = sum(fixed + row * d for fixed, row in self.direct_bytes)
        return sum(self.slab_bytes(d).values()) + direct

    def slab_bytes(self, depth: int) -> dict[str, int]:
        """Device bytes of the separable path's buffers for a slab of ``depth`` rows."""
        ny, nz = self.shape[1:]
        p1, p2 = self.padded_yz
        rows = depth + self.halo_lo[0] + self.halo_hi[0]
        if not self.n_separable:
            return {}
        return {
            "source": min(rows, self.shape[0]) * ny * nz * self.src_dtype.itemsize,
            "padded": rows * p1 * p2 * self.pad_dtype.itemsize,
            # blocked passes load up to U - 1 rows past the last they need (unused): slack
            "fast": (rows * p1 + MID_ROWS) * self.row * 4,
            "mid": (rows + self.rows) * ny * self.row * 4,
            "responses": self.n_separable * depth * ny * nz * 4,
        }


def make_separable_plan(
    filters: object,
    shape: tuple[int, int, int],
    dtype: np.dtype,
    mode: str,
    cval: float,
    device: cl.Device,
    *,
    choices: Sequence[Choice] | None = None,
    slab_depth: int | None = None,
    memory_budget: int | None = None,
    vector_width: int | None = None,
    rows: int | None = None,
    block_rows: int = BLOCK_ROWS,
    stream: bool = False,
    **overrides: object,
) -> SeparablePlan:
    """Plan a bank on the separable path without building anything (``volconv validate``):
    the paths (`plan_bank` unless ``choices`` are given), the common halo, the direct groups
    and the deepest slab whose buffers fit ``memory_budget`` (default: a quarter of the
    device's memory, at most 2 GiB) and the device's largest allocation; ``stream`` caps it
    so that reading, computing and writing overlap, as `volconv.plan.make_plan` does."""
    entries = _entries(filters)
    mode, cval = check_mode(mode), check_cval(cval)
    check_volume_dtype(dtype)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"volume must be 3D and non-empty; got shape {tuple(shape)}")
    kind = device_kind(device)
    vector_width = PASS_SHAPE[kind][0] if vector_width is None else vector_width
    rows = PASS_SHAPE[kind][1] if rows is None else rows
    if vector_width not in (1, 2, 4, 8, 16):
        raise ValueError(f"vector_width must be 1, 2, 4, 8 or 16; got {vector_width}")
    choices = tuple(plan_bank(filters, kind=kind) if choices is None else choices)
    if len(choices) != len(entries):
        raise ValueError(f"choices: {len(choices)} for {len(entries)} filters")
    shape = tuple(int(s) for s in shape)
    src = native_volume(np.empty(0, dtype)).dtype
    halos = [[halo(e) for e in k.shape] for k, _ in entries]
    lo = tuple(max(h[d][0] for h in halos) for d in range(3))
    hi = tuple(max(h[d][1] for h in halos) for d in range(3))
    by_extent: dict[tuple[int, ...], list[int]] = {}
    for f, c in enumerate(choices):
        if c.path == "direct":
            by_extent.setdefault(c.extent, []).append(f)
    groups = tuple(tuple(g) for g in by_extent.values())
    direct, allocs = [], []
    for g in groups:
        p = make_plan(
            shape, src, choices[g[0]].extent, len(g), mode, cval, device, slab_depth=1,
            **overrides,
        )  # fmt: skip
        zero, one = p.slab_bytes(0), p.slab_bytes(1)
        direct.append((sum(zero.values()), sum(one.values())))
        allocs.append((zero, one))
    plan = SeparablePlan(
        shape, len(entries), mode, cval, src, pad_dtype_for(src, mode, cval), lo, hi,
        vector_width, int(rows), int(block_rows), shape[0], choices, groups, tuple(direct),
    )  # fmt: skip
    if slab_depth is None:
        budget = memory_budget or min(device.global_mem_size // 4, 2 << 30)
        allocs.append((plan.slab_bytes(0), plan.slab_bytes(1)))
        fixed = sum(sum(zero.values()) for zero, _ in allocs)
        per_row = sum(sum(one.values()) for _, one in allocs)
        slab_depth = (budget - fixed) // max(per_row, 1)
        for zero, one in allocs:
            for name, size in one.items():
                if size:
                    slab_depth = min(slab_depth, (device.max_mem_alloc_size - zero[name]) // size)
        if slab_depth < 1:
            raise ValueError(
                f"memory_budget: {budget} bytes hold no slab of a {shape} volume "
                f"(one output row needs {per_row} bytes)"
            )
        if stream:
            slab_depth = min(slab_depth, streaming_depth(shape[0]))
    return replace(plan, slab_depth=max(1, min(int(slab_depth), shape[0])))


class SeparableConvolver(SlabConvolver):
    """A bank convolution that takes the separable path where the plan says so.

    Same slab interface as `BankConvolver`: `slabs`, `source_rows`, `convolve_slab`,
    `pinned_slab`, `timings` (device seconds per stage from profiling events), `plan`
    (``slab_depth``, ``n_slabs``, ...), `gflop`, plus `executed_gflop` and `kernel_bytes`.

    Parameters
    ----------
    filters : list of Filter, (N, kx, ky, kz) array or list of 3D arrays
        The bank; responses come in this order. Extents may differ per filter.
    shape, dtype
        Shape and element type of the 3D volumes to filter.
    mode, cval
        scipy.ndimage boundary mode and constant value.
    device
        A ``pyopencl.Device`` or a device spec.
    choices
        Per-filter `Choice`s (default: `plan_bank(filters)`).
    slab_depth, memory_budget
        Force the slab depth, or bound the device memory (bytes) of all buffers.
    vector_width
        Outputs per work-item of the passes along axis 2.
    **overrides
        Plan knobs for the direct groups (see `volconv.plan.make_plan`).
    """

    def __init__(
        self,
        filters: object,
        shape: tuple[int, int, int],
        dtype: np.dtype,
        mode: str = "reflect",
        cval: float = 0.0,
        *,
        device: cl.Device | str | None = None,
        choices: Sequence[Choice] | None = None,
        slab_depth: int | None = None,
        memory_budget: int | None = None,
        vector_width: int | None = None,
        rows: int | None = None,
        block_rows: int = BLOCK_ROWS,
        **overrides: object,
    ) -> None:
        self.device = device if isinstance(device, cl.Device) else select_device(device)
        self.ctx, self.queue = context_for(self.device)
        self.plan = make_separable_plan(
            filters, shape, dtype, mode, cval, self.device, choices=choices,
            slab_depth=slab_depth, memory_budget=memory_budget, vector_width=vector_width,
            rows=rows, block_rows=block_rows, **overrides,
        )  # fmt: skip
        plan = self.plan
        self.kernels = [k for k, _ in _entries(filters)]
        self._groups = [list(g) for g in plan.groups]
        self._direct = [
            BankConvolver(
                np.stack([self.kernels[f] for f in idx]),
                plan.shape,
                dtype,
                plan.mode,
                plan.cval,
                device=self.device,
                slab_depth=plan.slab_depth,
                **overrides,
            )
            for idx in self._groups
        ]
        self.timings = dict.fromkeys(STAGES, 0.0)
        self._slots = [f for f, c in enumerate(plan.choices) if c.path != "direct"]
        self._override: NonFiniteOverride | None = None
        if self._slots:
            self._setup()

    def _setup(self) -> None:
        plan, ctx = self.plan, self.ctx
        mf = cl.mem_flags
        lo, hi = plan.halo_lo, plan.halo_hi

        def node(parent: dict, a: np.ndarray, d: int) -> _Node:
            k = len(a)
            key = _key(a)
            if key not in parent:
                off = lo[d] - halo(k)[0]
                parent[key] = _Node(k, off, np.ascontiguousarray(a[::-1], np.float32))
            return parent[key]

        self._roots: dict = {}
        for slot, f in enumerate(self._slots):
            for t in plan.choices[f].terms:
                a0, a1, a2 = t.axes
                leaf = node(node(node(self._roots, a2, 2).children, a1, 1).children, a0, 0)
                leaf.targets.append((slot, t.coef))
        # the order of launches fixes which term writes a response first
        written: set[int] = set()
        self._launches = []
        for root in self._roots.values():
            for mid in root.children.values():
                for leaf in mid.children.values():
                    codes = []
                    for slot, _ in leaf.targets:
                        codes.append(slot if slot in written else -1 - slot)
                        written.add(slot)
                    coefs = np.array([c for _, c in leaf.targets], np.float32)
                    leaf.target_buf = cl.Buffer(
                        ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=np.array(codes, np.int32)
                    )
                    leaf.coef_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=coefs)
        # rows each pass must produce: leaves need [off, off + depth + k - 1) along axis 0
        for root in self._roots.values():
            for mid in root.children.values():
                mid.lo = min(leaf.off for leaf in mid.children.values())
                mid.extra = max(leaf.off + leaf.k - 1 for leaf in mid.children.values()) - mid.lo
            root.lo = min(m.lo for m in root.children.values())
            root.extra = max(m.lo + m.extra for m in root.children.values()) - root.lo
            root.y_lo = min(m.off for m in root.children.values())
            root.y_n = max(m.off + m.k - 1 for m in root.children.values()) - root.y_lo
        for n in self._nodes():
            n.buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=n.taps)

        pad_t = CL_TYPES[plan.pad_dtype]
        self.padder = Padder(
            ctx, self.queue, plan.shape, plan.src_dtype, plan.pad_dtype, lo, hi, plan.mode,
            plan.cval, plan.padded_yz, plan.slab_depth, frame_bytes(self.device),
        )  # fmt: skip
        self._programs: dict[int, cl.Program] = {}
        for n in self._nodes():
            if n.k not in self._programs:
                defines = (
                    ("K", n.k), ("V", plan.vector_width), ("U", plan.rows), ("UM", MID_ROWS),
                    ("IN_T", pad_t),
                )  # fmt: skip
                prog = build(ctx, "separable.cl", defines)
                self._programs[n.k] = {
                    name: cl.Kernel(prog, name) for name in ("pass_fast", "pass_mid", "pass_out")
                }
        sizes = plan.slab_bytes(plan.slab_depth)
        self._padded = cl.Buffer(ctx, mf.READ_WRITE, sizes["padded"])
        self._fast = cl.Buffer(ctx, mf.READ_WRITE, sizes["fast"])
        self._mid = cl.Buffer(ctx, mf.READ_WRITE, sizes["mid"])
        self._out = cl.Buffer(ctx, mf.READ_WRITE, sizes["responses"])

    def _planes(self) -> int:
        return len(self._slots)  # the direct groups download their own

    def store(self, dtype: str, scale: float = 1.0, offset: float = 0.0) -> None:
        super().store(dtype, scale, offset)
        for conv in self._direct:
            conv.store(dtype, scale, offset)

    @property
    def counts(self) -> tuple[int, int]:
        nans, clipped = super().counts
        for conv in self._direct:
            nans, clipped = nans + conv.counts[0], clipped + conv.counts[1]
        return nans, clipped

    def _nodes(self) -> Iterator[_Node]:
        for root in self._roots.values():
            yield root
            for mid in root.children.values():
                yield mid
                yield from mid.children.values()

    # -- slabs -------------------------------------------------------------------------
    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows (axis 0) that output rows ``[a, b)`` read, for every filter."""
        plan = self.plan
        m0 = extend_indices(plan.shape[0], a - plan.halo_lo[0], b + plan.halo_hi[0], plan.mode)
        return np.unique(m0[m0 >= 0])

    def convolve_slab(
        self,
        a: int,
        b: int,
        rows: np.ndarray | None = None,
        out: np.ndarray | None = None,
        *,
        frame: np.ndarray | None = None,
    ) -> np.ndarray:
        """Responses ``(N, b - a, ny, nz)`` of output rows ``[a, b)``, in bank order.

        ``rows`` holds the volume at `source_rows(a, b)`, in that order; or ``frame`` the whole
        3D volume (see `BankConvolver.convolve_slab`). ``out``, if given, is a float32 array of
        that shape (or a view with contiguous filter planes), or one of the stored type
        (`store`), the default.
        """
        plan = self.plan
        ny, nz = plan.shape[1:]
        depth = b - a
        if not 0 <= a < b <= plan.shape[0] or depth > plan.slab_depth:
            raise ValueError(
                f"[a, b) = [{a}, {b}) is not a slab of at most {plan.slab_depth} rows in "
                f"[0, {plan.shape[0]})"
            )
        needed = self.source_rows(a, b)
        rows = slab_rows(a, b, needed, plan.shape, plan.src_dtype, rows, frame)
        shape = (plan.n_filters, depth, ny, nz)
        out = np.empty(shape, self.stored) if out is None else check_out(out, shape, self.stored)
        nonfinite = rows is not None and has_nonfinite(rows)
        if nonfinite and out.dtype != np.float32:
            return self._store_on_host(a, b, out, rows=rows)
        # the direct groups correct non-finite voxels themselves; the passes get them as 0
        raw, nonfinite = rows, bool(self._slots) and nonfinite
        for idx, conv in zip(self._groups, self._direct, strict=True):
            given = (
                {"frame": frame}
                if rows is None
                else {"rows": rows[np.searchsorted(needed, conv.source_rows(a, b))]}
            )
            before = dict(conv.timings)
            if idx == list(range(idx[0], idx[-1] + 1)):
                conv.convolve_slab(a, b, out=out[idx[0] : idx[-1] + 1], **given)
            else:
                out[idx] = conv.convolve_slab(a, b, **given)
            for stage, seconds in conv.timings.items():
                self.timings[stage] += seconds - before[stage]
        if not self._slots:
            return out
        if rows is None:
            t_up, t_pad = self.padder(a, b, self._padded, frame=frame)
        else:
            t_up, t_pad = self.padder(a, b, self._padded, rows=finite_part(rows) if nonfinite
                                      else rows)  # fmt: skip
        t_pass = self._launch_passes(depth)
        t_down = self._download(self._out, out, list(enumerate(self._slots)), depth * ny * nz)
        for stage, events in (("upload", t_up), ("pad", [t_pad]), ("kernel", t_pass),
                              ("download", t_down)):  # fmt: skip
            self.timings[stage] += device_seconds(events)
        if nonfinite:
            self._correct(a, b, raw, needed, out)
        return out

    def _correct(self, a: int, b: int, rows: np.ndarray, needed: np.ndarray, out: np.ndarray):
        """Set the outputs of the separable filters that non-finite voxels reach, as scipy
        does; the counts run on the direct engine over the slots' own common halo."""
        if self._override is None:
            plan = self.plan
            kernels = stack_kernels([self.kernels[f] for f in self._slots])
            self._override_lo = tuple(halo(e)[0] for e in kernels.shape[1:])
            self._override_hi = tuple(halo(e)[1] for e in kernels.shape[1:])

            def counting(supports: np.ndarray) -> BankConvolver:
                return BankConvolver(supports, plan.shape, np.uint8, plan.mode, 0.0,
                                     device=self.device, slab_depth=plan.slab_depth)  # fmt: skip

            self._override = NonFiniteOverride(kernels, counting)
        m0 = extend_indices(self.plan.shape[0], a - self._override_lo[0],
                            b + self._override_hi[0], self.plan.mode)  # fmt: skip
        sub = rows[np.searchsorted(needed, np.unique(m0[m0 >= 0]))]
        slots = out[self._slots]
        for stage, seconds in self._override.apply(a, b, sub, slots).items():
            self.timings[stage] += seconds
        out[self._slots] = slots

    def _launch_passes(self, depth: int) -> list[cl.Event]:
        """Enqueue the pass tree over the padded slab of ``depth`` output rows."""
        events = []
        block = self.plan.block_rows or depth
        for root in self._roots.values():
            for c0 in range(0, depth, block):
                rows = min(block, depth - c0)  # output rows [c0, c0 + rows) of the slab
                events += self._launch_root(root, c0, rows, depth)
        return events

    def _launch_root(self, root: _Node, c0: int, rows: int, depth: int) -> list[cl.Event]:
        """Enqueue one root's subtree for output rows ``[c0, c0 + rows)`` of the slab."""
        plan, queue = self.plan, self.queue
        ny, nz = plan.shape[1:]
        p1, p2 = plan.padded_yz
        r, v, u = plan.row, plan.vector_width, plan.rows
        i32 = np.int32
        knl = self._programs[root.k]["pass_fast"]
        nx, n1 = rows + root.extra, ny + root.y_n
        knl.set_args(
            self._padded, self._fast, root.buf, i32(root.lo + c0), i32(root.y_lo), i32(nx),
            i32(n1), i32(p1), i32(p2), i32(r), i32(root.off),
        )  # fmt: skip
        events = [cl.enqueue_nd_range_kernel(queue, knl, (r // v, n1, nx), None)]
        for mid in root.children.values():
            knl = self._programs[mid.k]["pass_mid"]
            nx = rows + mid.extra
            knl.set_args(
                self._fast, self._mid, mid.buf, i32(mid.lo + c0), i32(nx), i32(ny), i32(p1),
                i32(r), i32(mid.off),
            )  # fmt: skip
            glob = (r // v, -(-ny // MID_ROWS), nx)
            events.append(cl.enqueue_nd_range_kernel(queue, knl, glob, None))
            for leaf in mid.children.values():
                knl = self._programs[leaf.k]["pass_out"]
                knl.set_args(
                    self._mid, self._out, leaf.buf, leaf.target_buf, leaf.coef_buf,
                    i32(len(leaf.targets)), i32(c0), i32(c0 + rows), i32(depth), i32(ny),
                    i32(nz), i32(r), i32(leaf.off),
                )  # fmt: skip
                glob = (-(-nz // v), ny, -(-rows // u))
                events.append(cl.enqueue_nd_range_kernel(queue, knl, glob, None))
        return events

    def time_kernel(self, a: int, b: int, repeats: int = 10) -> np.ndarray:
        """Seconds of the filtering kernels alone (passes and direct groups) for output rows
        ``[a, b)``, once per repeat, re-run on what the last `convolve_slab` of ``[a, b)``
        left on the device; for benchmarks."""
        seconds = np.zeros(repeats)
        for conv in self._direct:
            seconds += conv.time_kernel(a, b, repeats)
        if self._slots:
            for r in range(repeats):
                events = self._launch_passes(b - a)
                cl.wait_for_events(events)
                seconds[r] += device_seconds(events)
        return seconds

    # -- work --------------------------------------------------------------------------
    @property
    def pass_counts(self) -> tuple[int, int, int]:
        """Launches per slab along axes 2, 1 and 0: distinct axis-2 factors, distinct
        (axis-2, axis-1) pairs, distinct terms."""
        if not self._slots:
            return 0, 0, 0
        mids = [m for r in self._roots.values() for m in r.children.values()]
        return len(self._roots), len(mids), sum(len(m.children) for m in mids)

    @property
    def engines(self) -> list[str]:
        """The paths taken: 'separable' for the passes, 'fp32' for the direct kernel."""
        return (["separable"] if self._slots else []) + (["fp32"] if self._direct else [])

    @property
    def gflop(self) -> float:
        """Useful GFLOP of one volume, as SPEC.md counts it: 2 * voxels * sum_k prod(extent_k)
        over each filter's own extent."""
        return work_gflop([k.shape for k in self.kernels], math.prod(self.plan.shape))

    @property
    def executed_gflop(self) -> float:
        """GFLOP the kernels compute for one volume: the passes' taps over every output they
        produce (halo rows and the row tail included), the coefficient multiply-adds, and the
        direct groups' taps."""
        return self._work()[0] / 1e9 + sum(c.executed_gflop for c in self._direct)

    @property
    def kernel_bytes(self) -> int:
        """Bytes the passes read and write in global memory for one volume (each input element
        counted once per pass), for bandwidth; the direct groups are compute-bound, uncounted."""
        return self._work()[1]

    def _work(self) -> tuple[float, int]:
        if not self._slots:
            return 0.0, 0
        plan = self.plan
        ny, nz = plan.shape[1:]
        r = plan.row
        isz = plan.pad_dtype.itemsize
        flop = 0.0
        moved = 0
        for a, b in self.slabs():
            depth = b - a
            block = plan.block_rows or depth
            for c0 in range(0, depth, block):
                rows = min(block, depth - c0)
                for root in self._roots.values():
                    outs = (rows + root.extra) * (ny + root.y_n) * r
                    flop += 2 * root.k * outs
                    moved += outs * (isz + 4)
                    for mid in root.children.values():
                        outs = (rows + mid.extra) * ny * r
                        flop += 2 * mid.k * outs
                        moved += (outs + (rows + mid.extra) * (ny + mid.k - 1) * r) * 4
                        for leaf in mid.children.values():
                            outs = rows * ny * nz
                            flop += 2 * (leaf.k + len(leaf.targets)) * outs
                            moved += (rows + leaf.k - 1) * ny * r * 4
                            moved += outs * 4 * (2 * len(leaf.targets) - 1)
        return flop, moved


def convolve_separable(
    volume: np.ndarray,
    filters: object,
    mode: str = "reflect",
    cval: float = 0.0,
    *,
    device: cl.Device | str | None = None,
    **options: object,
) -> np.ndarray:
    """Apply a bank (each filter exactly as scipy.ndimage.convolve applies it) through
    `SeparableConvolver`; a 4D volume is filtered as t independent 3D volumes.

    Returns
    -------
    (N, *volume.shape) float32 array
    """
    if not isinstance(volume, np.ndarray):
        raise TypeError(f"volume must be a numpy array; got {type(volume).__name__}")
    check_volume_dtype(volume.dtype)
    if volume.ndim not in (3, 4):
        raise ValueError(f"volume must be 3D or 4D; got shape {volume.shape}")
    conv = SeparableConvolver(
        filters, volume.shape[:3], volume.dtype, mode, cval, device=device, **options
    )
    out = np.empty((conv.plan.n_filters, *volume.shape), np.float32)
    frames = [volume] if volume.ndim == 3 else [volume[..., t] for t in range(volume.shape[3])]
    for t, frame in enumerate(frames):
        for a, b in conv.slabs():
            rows = frame[conv.source_rows(a, b)]
            if volume.ndim == 3:
                conv.convolve_slab(a, b, rows, out[:, a:b])
            else:
                out[:, a:b, ..., t] = conv.convolve_slab(a, b, rows)
    return out

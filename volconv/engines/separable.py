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

On a GPU a bank whose tree fits (`fused_fits`) runs it in one kernel, kernels/fused.cl: the
tree as tables (`volconv.engines.passes.fused_tree`), each factor zero-padded to its axis's
window of the halo, the axis-2 and axis-1 passes through local-memory tiles and the axis-0
pass as running sums in registers, so no intermediate volume is written and each response is
written once; the device features are its epilogue, so a response only features read is
never written. Its own cost model plans such a bank (`plan_paths`); the pass tree runs the
rest and on CPUs, and kernels/features.cl computes the features after it. Both are in
`volconv.engines.passes`.

Non-finite voxels (NaN, +-Inf) are exact as in scipy, as on the direct path: the passes filter
the slab with them set to 0, and `volconv.engines.nonfinite` sets the outputs they reach.

In a pipeline, `SeparableConvolver` takes `BankConvolver`'s place: give it the bank's `Filter`
list (not the zero-padded stack, which would lose each filter's own extent and its factors);
`plan` has ``slab_depth``, ``n_slabs``, ``device_bytes`` and ``choices`` (`describe_plan` prints
them); the throughput record takes `gflop`, `executed_gflop`, `kernel_bytes` and `engines`.
`make_separable_plan` plans without building, for ``volconv validate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyopencl as cl

from volconv.bank.factor import Term, factorise, reconstruction_ok
from volconv.bank.features import DeviceFeature, Expanded, Feature, expand
from volconv.bank.filters import Filter, stack_kernels
from volconv.checks import check_cval, check_mode
from volconv.device.devices import select_device
from volconv.device.programs import context_for, device_seconds
from volconv.engines.boundary import extend_indices, halo, sources
from volconv.engines.choose import convolver_for, direct_plan
from volconv.engines.clock import KernelClock, merged
from volconv.engines.direct import (
    STAGES,
    BankConvolver,
    SlabConvolver,
    check_out,
    check_volume_dtype,
)
from volconv.engines.features import (
    FeatureKernels,
    StructureTensorStage,
    host_feature,
)
from volconv.engines.nonfinite import NonFiniteOverride, finite_part, has_nonfinite
from volconv.engines.padder import Padder, frame_bytes, native_volume, slab_rows
from volconv.engines.passes import MID_ROWS, FusedKernel, FusedTree, PassTree, fused_tree
from volconv.engines.scales import PresetStage
from volconv.plan.direct import (
    MAX_EXTENT,
    MAX_SEPARABLE_EXTENT,
    MAX_SEPARABLE_FILTERS,
    Plan,
    pad_dtype_for,
    streaming_depth,
)
from volconv.report import work_gflop

PATHS = ("direct", "separable", "low-rank")

# Cost model per output voxel, in units of one tap of the direct kernel: a 1D pass costs
# PASS_FIXED (reading and writing a float per output) plus PASS_PER_TAP a tap; only the ratios
# matter. Fitted by scripts/bench/separable.py ("cost_model") on PoCL and the H100: the
# figures and the fit are in benchmarks/README.md, "The measurements behind the defaults".
PASS_COSTS = {"cpu": (12.0, 3.0), "gpu": (48.0, 5.2)}  # (PASS_FIXED, PASS_PER_TAP)
# The fused kernel (kernels/fused.cl, a small bank's whole tree in one kernel) costs a filter
# its response's write plus the taps of its distinct passes (`separable_cost`), fitted alike.
FUSED_COSTS = {"gpu": (45.0, 3.9)}  # (per response, per tap)
MAX_TERMS = 8  # longest decomposition worth trying for a custom kernel

# Outputs per work-item of the passes along axis 2 (the vector width V) and along axis 0 in
# pass_out (rows U), per kind of device, as measured fastest (benchmarks/README.md).
PASS_SHAPE = {"cpu": (16, 4), "gpu": (2, 4)}  # (V, U)
BLOCK_ROWS = 0  # rows the tree runs over at a time; 0: the slab

# The fused kernel (kernels/fused.cl): a work-group's tile (TY, TZ) of output columns and its
# CX output rows along axis 0. GPUs take it by default for banks whose values held across a
# plane fit in registers: N_OUT responses x KX axis-0 taps of partial sums plus the N_MIDS
# mids' values at most MAX_FUSED_VALUES (measured: benchmarks/README.md).
FUSED_TILE = (8, 16, 32)  # (TY, TZ, CX)
MAX_FUSED_VALUES = 128
# ... and by default only where no window is longer than this: longer windows' tiles cost more
# than the passes (benchmarks/results/h100-features-final.json: a 25-tap smoothing of six
# planes 8.1 ms fused against 2.9 ms as passes; 9 taps fused win).
MAX_FUSED_TAPS = 13


@dataclass(frozen=True)
class Choice:
    """How one filter is computed.

    Attributes
    ----------
    path : {'direct', 'separable', 'low-rank'}
        'separable': the filter's own factors (a generated filter); 'low-rank': terms found by
        `volconv.bank.factor.factorise` for a custom kernel; 'direct': the k^3 kernel.
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
    """Cost per output voxel of a filter's terms on a ``kind`` of device, in direct taps:
    'cpu' and 'gpu' (the pass tree) each term's three passes, unshared; 'gpu-fused' its
    response's write and the taps of its distinct passes (sharing inside the filter counted:
    a LoG's three terms share an axis-2 Gaussian; across filters not)."""
    if kind == "gpu-fused":
        fixed, per_tap = FUSED_COSTS["gpu"]

        def key(a: np.ndarray) -> tuple[int, bytes]:  # float64: no overflow for wild factors
            return len(a), a.tobytes()

        roots = {key(t.axes[2]) for t in terms}
        mids = {(key(t.axes[2]), key(t.axes[1])) for t in terms}
        taps = sum(k for k, _ in roots) + sum(k for _, (k, _) in mids)
        return fixed + per_tap * (taps + len(mids) * max(len(t.axes[0]) for t in terms))
    fixed, per_tap = PASS_COSTS[kind]
    return sum(3 * fixed + per_tap * sum(t.extent) for t in terms)


def _entries(filters: object) -> list[tuple[np.ndarray, tuple[Term, ...] | None]]:
    """(kernel, known terms) per filter: from `Filter`s, an (N, kx, ky, kz) array or a list of
    3D arrays of any extents."""
    if isinstance(filters, np.ndarray):
        items = list(filters) if filters.ndim == 4 else [filters]
    else:
        items = list(filters)
    if not 1 <= len(items) <= MAX_SEPARABLE_FILTERS:
        raise ValueError(f"filters: N must be 1..{MAX_SEPARABLE_FILTERS}; got {len(items)}")
    out = []
    for i, item in enumerate(items):
        terms = item.factors if isinstance(item, Filter) else None
        k = np.asarray(item.kernel if isinstance(item, Filter) else item)
        if k.dtype.kind not in "biuf":
            raise TypeError(f"filter {i}: kernel must be real numbers; got dtype {k.dtype}")
        most = MAX_SEPARABLE_EXTENT if terms is not None else MAX_EXTENT  # passes: wider
        if k.ndim != 3 or not all(1 <= e <= most for e in k.shape):
            raise ValueError(f"filter {i}: kernel must be 3D with extents 1..{most}; got {k.shape}")
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
    kind : {'cpu', 'gpu', 'gpu-fused'}
        The cost model: the device's kind (`device_kind`), 'gpu-fused' for a GPU's fused
        kernel.
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
        if max(extent) > MAX_EXTENT and not take:
            raise ValueError(f"filter {len(choices)}: extent {extent} takes the separable path "
                             "only, and its factors do not reproduce it")  # fmt: skip
        choices.append(Choice(path if take else "direct", extent, terms, direct, cost))
    return choices


def plan_paths(
    filters: object,
    device: cl.Device,
    *,
    fused: bool | None = None,
    tile: tuple[int, int, int] | None = None,
    separable: Sequence[int] = (),
) -> list[Choice]:
    """`plan_bank` by the cost model of the kernels that will run on ``device``: on a GPU the
    fused kernel's, when the bank's separable filters then fit it (``fused`` None or True),
    else the pass tree's. The filters at indices ``separable`` (those derived features read
    on the device) take the separable path whatever the cost."""

    def forced(choices: list[Choice]) -> list[Choice]:
        for i in separable:
            if choices[i].path == "direct":
                choices[i] = plan_bank([filters[i]], force="separable")[0]
                if choices[i].path == "direct":
                    raise ValueError(f"filter {i}: a feature reads it and it has no factors")
        return choices

    kind = device_kind(device)
    if kind == "gpu" and fused is not False:
        choices = forced(plan_bank(filters, kind="gpu-fused"))
        lo, _ = _bank_halo(_entries(filters))
        if fused_fits(fused_tree(choices, lo), tile or FUSED_TILE, device):
            return choices
    return forced(plan_bank(filters, kind=kind))


def _bank_halo(entries: list) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The common halo before and after the outputs that covers every filter's extent."""
    halos = [[halo(e) for e in k.shape] for k, _ in entries]
    lo = tuple(max(h[d][0] for h in halos) for d in range(3))
    hi = tuple(max(h[d][1] for h in halos) for d in range(3))
    return lo, hi


def describe_plan(
    choices: Sequence[Choice], names: Sequence[str] | None = None, fused: bool = False
) -> str:
    """One line per filter, as `volconv validate` prints the plan (``fused``: the plan runs
    the separable filters in one kernel)."""
    names = names or [f"filter {i}" for i in range(len(choices))]
    width = max(len(n) for n in names)
    counts = {p: sum(c.path == p for c in choices) for p in PATHS}
    head = ", ".join(f"{n} {p}" for p, n in counts.items() if n)
    lines = [f"paths: {head}" + (" (in one fused kernel)" if fused else "")]
    lines += [f"  {n:<{width}}  {c.describe()}" for n, c in zip(names, choices, strict=True)]
    return "\n".join(lines)


@dataclass(frozen=True)
class SeparablePlan:
    """Sizes of one separable bank convolution, and its direct groups' plans."""

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
    fused: bool = False  # one kernel (kernels/fused.cl) rather than the pass tree
    tile: tuple[int, int, int] = FUSED_TILE  # the fused kernel's (TY, TZ, CX)
    n_stored: int | None = None  # the first n_stored filters are stored (None: all)
    feature_planes: int = 0  # feature outputs kernels/features.cl computes on the device
    n_tensor: int = 0  # outputs of structure tensors (engines.features.StructureTensorStage)
    direct_plans: tuple[Plan, ...] = ()  # per group: its engine's plan (`direct_plan`)

    @property
    def stored(self) -> int:
        """Filters whose responses are stored (the first ones)."""
        return self.n_filters if self.n_stored is None else self.n_stored

    @property
    def n_outputs(self) -> int:
        """Volumes per voxel the convolver gives: stored responses, then features."""
        return self.stored + self.feature_planes + self.n_tensor

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
        sizes = {
            "source": min(rows, self.shape[0]) * ny * nz * self.src_dtype.itemsize,
            "padded": rows * p1 * p2 * self.pad_dtype.itemsize,
            # blocked passes load up to U - 1 rows past the last they need (unused): slack
            "fast": (rows * p1 + MID_ROWS) * self.row * 4,
            "mid": (rows + self.rows) * ny * self.row * 4,
            "responses": self.n_separable * depth * ny * nz * 4,
            "features": self.feature_planes * depth * ny * nz * 4,
        }
        if self.fused:  # no intermediates
            del sizes["fast"], sizes["mid"]
        return sizes


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
    fused: bool | None = None,
    tile: tuple[int, int, int] | None = None,
    stream: bool = False,
    n_stored: int | None = None,
    feature_planes: int = 0,
    n_tensor: int = 0,
    engine: str | None = None,
    **overrides: object,
) -> SeparablePlan:
    """Plan a bank on the separable path without building anything (``volconv validate``):
    the paths (`plan_bank` unless ``choices`` are given), the common halo, the direct groups
    and the deepest slab whose buffers fit ``memory_budget`` (default: a quarter of the
    device's memory, at most 2 GiB) and the device's largest allocation; ``stream`` caps it
    so that reading, computing and writing overlap, as `volconv.plan.direct.make_plan` does.

    ``fused`` (default: on GPUs) runs the separable filters in one kernel when their tree fits
    it (`fused_fits`); else, or when it is False, as the pass tree (the paths, if not given,
    by `plan_paths`). True where the tree does not fit is an error."""
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
    tile = FUSED_TILE if tile is None else tuple(int(t) for t in tile)
    if len(tile) != 3 or min(tile) < 1:
        raise ValueError(f"tile must be 3 positive ints (TY, TZ, CX); got {tile}")
    lo, hi = _bank_halo(entries)
    if choices is None:
        choices = plan_paths(filters, device, fused=fused, tile=tile)
    choices = tuple(choices)
    if len(choices) != len(entries):
        raise ValueError(f"choices: {len(choices)} for {len(entries)} filters")
    tree = fused_tree(choices, lo)
    want = kind == "gpu" if fused is None else bool(fused)
    if fused is None and tree is not None and max(tree.taps) > MAX_FUSED_TAPS:
        want = False
    if want and not fused_fits(tree, tile, device):
        if fused:
            raise ValueError(
                f"fused: the bank's separable filters do not fit the fused kernel (at most "
                f"{MAX_FUSED_VALUES} responses x axis-0 taps + distinct (axis-2, axis-1) "
                f"pairs, and its tiles in local memory)"
            )
        want = False
    shape = tuple(int(s) for s in shape)
    src = native_volume(np.empty(0, dtype)).dtype
    by_extent: dict[tuple[int, ...], list[int]] = {}
    for f, c in enumerate(choices):
        if c.path == "direct":
            by_extent.setdefault(c.extent, []).append(f)
    groups = tuple(tuple(g) for g in by_extent.values())
    direct, allocs, plans = [], [], []
    for g in groups:  # each group's engine chosen and planned here, once
        p = direct_plan(np.stack([entries[f][0] for f in g]), shape, dtype, mode, cval,
                        device=device, engine=engine, slab_depth=1, **overrides)  # fmt: skip
        zero, one = p.slab_bytes(0), p.slab_bytes(1)
        direct.append((sum(zero.values()), sum(one.values())))
        allocs.append((zero, one))
        plans.append(p)
    plan = SeparablePlan(
        shape, len(entries), mode, cval, src, pad_dtype_for(src, mode, cval), lo, hi,
        vector_width, int(rows), int(block_rows), shape[0], choices, groups, tuple(direct),
        want, tile, n_stored, int(feature_planes), int(n_tensor), tuple(plans),
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
        if stream:  # at least the halo deep: wide filters would redo it more than once
            slab_depth = min(slab_depth, max(streaming_depth(shape[0]), lo[0] + hi[0]))
    return replace(plan, slab_depth=max(1, min(int(slab_depth), shape[0])))


def fused_fits(tree: FusedTree | None, tile: tuple[int, int, int], device: cl.Device) -> bool:
    """Whether the fused kernel can run ``tree``: its values in registers, its tiles (two of
    each) in the device's local memory."""
    if tree is None:
        return False
    ty, tz, _ = tile
    tile_y = ty + tree.taps[1] - 1
    local = 2 * (tile_y * (tz + tree.taps[2] - 1) + len(tree.wz) * tile_y * tz) * 4
    return (
        tree.values <= MAX_FUSED_VALUES
        and local <= device.local_mem_size
        and ty * tz <= device.max_work_group_size
    )


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
    vector_width, rows, block_rows
        The pass tree's shape: outputs per work-item along axis 2 and axis 0, and the output
        rows it runs over at a time.
    fused, tile
        One kernel for the separable filters (default: on GPUs, where the bank fits it), and
        its work-group tile (see `make_separable_plan`).
    engine : {'auto', 'fp32', 'tensor'}, optional
        The direct groups' engine (`volconv.engines.choose.direct_convolver`; default
        $VOLCONV_ENGINE or 'auto': the tensor cores where the device and bank allow).
    expanded : volconv.bank.features.Expanded, optional
        Derived features: ``filters`` is then ``expanded.filters`` (the bank's, then those
        only features read), the first ``expanded.n_stored`` responses are given, then each
        feature's outputs (`plan.n_outputs` volumes in all). The filters the device features
        read must be on the separable path (`plan_paths`' ``separable``).
    **overrides
        Plan knobs for the direct groups (see `volconv.plan.direct.make_plan`).
    plan : SeparablePlan, optional
        The plan `make_separable_plan` made for these filters, shape and type (a pipeline's
        job holds it): taken as it is, with its mode, cval, paths and slab depth, instead of
        planning again from the arguments above.
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
        engine: str | None = None,
        fused: bool | None = None,
        tile: tuple[int, int, int] | None = None,
        expanded: Expanded | None = None,
        plan: SeparablePlan | None = None,
        **overrides: object,
    ) -> None:
        self.device = device if isinstance(device, cl.Device) else select_device(device)
        self.ctx, self.queue = context_for(self.device)
        if plan is None:  # else the plan the pipeline made once (`make_separable_plan`)
            sizes: dict[str, int] = {}
            if expanded is not None:
                if choices is None:
                    choices = plan_paths(filters, self.device, fused=fused, tile=tile,
                                         separable=expanded.separable)  # fmt: skip
                sizes = expanded.plan_sizes()
            plan = make_separable_plan(
                filters, shape, dtype, mode, cval, self.device, choices=choices,
                slab_depth=slab_depth, memory_budget=memory_budget, vector_width=vector_width,
                rows=rows, block_rows=block_rows, fused=fused, tile=tile, engine=engine, **sizes,
                **overrides,
            )  # fmt: skip
        self.plan = plan
        self.expanded = expanded
        self.kernels = [k for k, _ in _entries(filters)]
        self._groups = [list(g) for g in plan.groups]
        self._direct = [  # the groups' plans, made with the bank's, at its slab depth
            convolver_for(
                np.stack([self.kernels[f] for f in idx]),
                dtype,
                replace(p, slab_depth=plan.slab_depth),
                device=self.device,
            )
            for idx, p in zip(self._groups, plan.direct_plans, strict=True)
        ]
        self.timings = dict.fromkeys(STAGES, 0.0)
        self.clock = KernelClock()  # device seconds per kernel name
        self._slots = [f for f, c in enumerate(plan.choices) if c.path != "direct"]
        self._override: NonFiniteOverride | None = None
        if any(f >= plan.stored for idx in self._groups for f in idx):
            raise ValueError("expanded: every filter only features read must be separable")
        self._features: list[DeviceFeature] = list(expanded.device) if expanded else []
        self._feature_kernels: FeatureKernels | None = None
        self._tensors: list[tuple[StructureTensorStage | PresetStage, tuple[int, ...]]] = []
        if expanded is not None and (self._features or expanded.tensors or expanded.presets):
            self._feature_kernels = FeatureKernels(self.ctx, self.queue)
            for feat, at in expanded.tensors:
                stage = StructureTensorStage(
                    feat, plan.shape, dtype, plan.mode, plan.cval, self.device,
                    plan.slab_depth, self._feature_kernels, fused=fused,
                )  # fmt: skip
                self._tensors.append((stage, at))
            for preset, at in expanded.presets:
                stage = PresetStage(preset, plan.shape, dtype, plan.mode, plan.cval,
                                    self.device, plan.slab_depth)  # fmt: skip
                self._tensors.append((stage, at))
        # responses that feed nothing (structure tensors or presets only: the filter `expand`
        # adds so that a convolver runs one) are not computed
        self._idle = not self._features and not any(f < plan.stored for f in self._slots)
        if self._slots:
            self._setup()

    def _setup(self) -> None:
        plan, ctx = self.plan, self.ctx
        mf = cl.mem_flags
        lo, hi = plan.halo_lo, plan.halo_hi
        self.padder = Padder(
            ctx, self.queue, plan.shape, plan.src_dtype, plan.pad_dtype, lo, hi, plan.mode,
            plan.cval, plan.padded_yz, plan.slab_depth, frame_bytes(self.device),
        )  # fmt: skip
        sizes = plan.slab_bytes(plan.slab_depth)
        self._padded = cl.Buffer(ctx, mf.READ_WRITE, sizes["padded"])
        self._out = cl.Buffer(ctx, mf.READ_WRITE, sizes["responses"])
        if sizes["features"]:
            self._feat = cl.Buffer(ctx, mf.READ_WRITE, sizes["features"])
        self._tree = fused_tree(plan.choices, lo)
        if plan.fused:
            n_stored = sum(f < plan.stored for f in self._slots)
            self._passes = FusedKernel(ctx, self.queue, plan, self._tree, self._epilogue(),
                                       n_stored, plan.feature_planes, self.clock)  # fmt: skip
        else:
            self._passes = PassTree(ctx, self.queue, plan, self._slots, self.clock)

    def _planes(self) -> int:
        # the direct groups download their own; the stored separable responses, then the
        # feature planes, are converted one download after the other
        stored = sum(f < self.plan.stored for f in self._slots)
        return max(stored, self.plan.feature_planes)

    def pinned_slab(self) -> np.ndarray:
        """A ``(plan.n_outputs, slab_depth, ny, nz)`` array of the stored type in page-locked
        host memory (see `volconv.engines.direct.SlabConvolver.pinned_slab`)."""
        plan = self.plan
        shape = (plan.n_outputs, plan.slab_depth, *plan.shape[1:])
        mf = cl.mem_flags
        size = self.stored.itemsize * math.prod(shape)
        buf = cl.Buffer(self.ctx, mf.READ_WRITE | mf.ALLOC_HOST_PTR, size)
        flags = cl.map_flags.READ | cl.map_flags.WRITE
        array, _ = cl.enqueue_map_buffer(self.queue, buf, flags, 0, shape, self.stored)
        return array

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

    # -- slabs -------------------------------------------------------------------------
    def source_rows(self, a: int, b: int) -> np.ndarray:
        """Sorted source rows (axis 0) that output rows ``[a, b)`` read, for every filter (and
        structure tensor)."""
        rows = self._own_rows(a, b)
        if self._tensors:
            parts = [rows] + [stage.source_rows(a, b) for stage, _ in self._tensors]
            rows = sources(np.concatenate(parts))
        return rows

    def _own_rows(self, a: int, b: int) -> np.ndarray:
        plan = self.plan
        m0 = extend_indices(plan.shape[0], a - plan.halo_lo[0], b + plan.halo_hi[0], plan.mode)
        return sources(m0)

    def convolve_slab(
        self,
        a: int,
        b: int,
        rows: np.ndarray | None = None,
        out: np.ndarray | None = None,
        *,
        frame: np.ndarray | None = None,
    ) -> np.ndarray:
        """Responses ``(N, b - a, ny, nz)`` of output rows ``[a, b)``, in bank order, then
        the features' outputs (``N = plan.n_outputs``).

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
        shape = (plan.n_outputs, depth, ny, nz)
        out = np.empty(shape, self.stored) if out is None else check_out(out, shape, self.stored)
        nonfinite = rows is not None and has_nonfinite(rows)
        if (nonfinite or self._tensors) and out.dtype != np.float32:
            given = {"frame": frame} if rows is None else {"rows": rows}
            return self._store_on_host(a, b, out, **given)
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
        if self._slots and not self._idle:
            self._separable_slab(a, b, raw, needed, frame, nonfinite, out)
        for stage, at in self._tensors:
            before = [dict(c.timings) for c in stage.convolvers]
            t0 = stage.seconds
            if getattr(stage, "fills_out", False):  # downloads into out itself
                stage.compute(a, b, raw, needed, frame, out=out[at[0] : at[-1] + 1])
            else:
                out[at[0] : at[-1] + 1] = stage.compute(a, b, raw, needed, frame)
            for conv, was in zip(stage.convolvers, before, strict=True):
                for name, seconds in conv.timings.items():
                    self.timings[name] += seconds - was[name]
            self.timings["kernel"] += stage.seconds - t0
        for clock in self._clocks():  # their events are complete: let them go
            clock.settle()
        return out

    def _separable_slab(
        self, a: int, b: int, rows: np.ndarray | None, needed: np.ndarray,
        frame: np.ndarray | None, nonfinite: bool, out: np.ndarray,
    ) -> None:  # fmt: skip
        """The separable responses of ``[a, b)`` and the features computed from them, into
        ``out``."""
        plan = self.plan
        ny, nz = plan.shape[1:]
        depth = b - a
        n = depth * ny * nz
        if rows is None:
            t_up, t_pad = self.padder(a, b, self._padded, frame=frame)
        else:
            own = rows if not self._tensors else rows[np.searchsorted(needed, self._own_rows(a, b))]
            t_up, t_pad = self.padder(a, b, self._padded, rows=finite_part(own) if nonfinite
                                      else own)  # fmt: skip
        t_pass = self._launch_passes(depth, every=nonfinite)
        stored = [(s, f) for s, f in enumerate(self._slots) if f < plan.stored]
        slot_of = {f: s for s, f in enumerate(self._slots)}
        if nonfinite:  # every separable response to the host, set as scipy sets it there
            resp = np.empty((len(self._slots), depth, ny, nz), np.float32)
            t_down = self._download(self._out, resp, [(s, s) for s in range(len(resp))], n)
            self._correct(a, b, rows, needed, resp)
            for s, f in stored:
                out[f] = resp[s]
            for feat in self._features:
                values = host_feature(feat.kernel, [resp[slot_of[i]] for i in feat.inputs])
                for o, v in zip(feat.at, values, strict=True):
                    out[o] = v
        else:
            t_pass += self._launch_features(n)
            t_down = self._download(self._out, out, stored, n) if stored else []
            if self._features:
                targets = list(enumerate(o for feat in self._features for o in feat.at))
                t_down += self._download(self._feat, out, targets, n)
        cl.wait_for_events(t_pass)  # where nothing of them is downloaded
        for stage, events in (("upload", t_up), ("pad", [t_pad]), ("kernel", t_pass),
                              ("download", t_down)):  # fmt: skip
            self.timings[stage] += device_seconds(events)

    def _epilogue(self) -> str:
        """The device features as kernels/fused.cl's FEATURES: a macro per feature, reading
        responses by slot, writing feature planes in order."""
        slot_of = {f: s for s, f in enumerate(self._slots)}
        calls, o = [], 0
        for feat in self._features:
            slots = [slot_of[i] for i in feat.inputs]
            name = {"eigen3": "EIG3", "pick": "PICK", "difference": "DIFF"}.get(
                feat.kernel, f"MAG{len(slots)}"
            )
            calls.append(f"{name}({','.join(map(str, [*slots, o]))})")
            o += len(feat.at)
        return "".join(calls)

    def _launch_features(self, n: int) -> list[cl.Event]:
        """Enqueue the device features over the ``n`` voxels of the slab's responses (the
        fused kernel computes them itself)."""
        if self.plan.fused:
            return []
        slot_of = {f: s for s, f in enumerate(self._slots)}
        events, o = [], 0
        for feat in self._features:
            slots = [slot_of[i] for i in feat.inputs]
            events.append(self._feature_kernels.launch(feat.kernel, self._out, slots,
                                                       self._feat, o, n))  # fmt: skip
            o += len(feat.at)
        return events

    def _correct(self, a: int, b: int, rows: np.ndarray, needed: np.ndarray, slots: np.ndarray):
        """Set the responses ``slots`` (one per separable filter) that non-finite voxels
        reach, as scipy does; the counts run on the direct engine over the slots' own common
        halo."""
        if self._override is None:
            plan = self.plan
            if any(max(self.kernels[f].shape) > MAX_EXTENT for f in self._slots):
                raise ValueError(
                    f"non-finite voxels (NaN, Inf) in rows [{a}, {b}): their reach is counted "
                    f"for filters of at most {MAX_EXTENT} taps per axis; this bank has wider "
                    "ones (replace the non-finite voxels first)"
                )
            kernels = stack_kernels([self.kernels[f] for f in self._slots])
            self._override_lo = tuple(halo(e)[0] for e in kernels.shape[1:])
            self._override_hi = tuple(halo(e)[1] for e in kernels.shape[1:])

            def counting(supports: np.ndarray) -> BankConvolver:
                return BankConvolver(supports, plan.shape, np.uint8, plan.mode, 0.0,
                                     device=self.device, slab_depth=plan.slab_depth)  # fmt: skip

            self._override = NonFiniteOverride(kernels, counting)
        m0 = extend_indices(self.plan.shape[0], a - self._override_lo[0],
                            b + self._override_hi[0], self.plan.mode)  # fmt: skip
        sub = rows[np.searchsorted(needed, sources(m0))]
        for stage, seconds in self._override.apply(a, b, sub, slots).items():
            self.timings[stage] += seconds

    def _launch_passes(self, depth: int, every: bool = False) -> list[cl.Event]:
        """Enqueue the pass tree (or the fused kernel) over the padded slab of ``depth``
        output rows: every response, or (fused, ``every`` False) the stored ones and the
        device features."""
        if self.plan.fused:
            feat = self._feat if self._features else self._out
            return [self._passes.launch(self._padded, self._out, feat, depth, every)]
        return self._passes.launch(self._padded, self._out, depth)

    def time_kernel(self, a: int, b: int, repeats: int = 10) -> np.ndarray:
        """Seconds of the filtering kernels alone (passes and direct groups) for output rows
        ``[a, b)``, once per repeat, re-run on what the last `convolve_slab` of ``[a, b)``
        left on the device; for benchmarks."""
        seconds = np.zeros(repeats)
        for conv in self._direct:
            seconds += conv.time_kernel(a, b, repeats)
        if self._slots:
            n = (b - a) * math.prod(self.plan.shape[1:])
            for r in range(repeats):
                events = self._launch_passes(b - a) + self._launch_features(n)
                cl.wait_for_events(events)
                seconds[r] += device_seconds(events)
        return seconds

    @property
    def kernel_seconds(self) -> dict[str, float]:
        """Device seconds per kernel name (passes, features, a structure tensor's stages)
        since the convolver was made; the direct groups' are in `timings` only."""
        return merged(self._clocks())

    def _clocks(self) -> list[KernelClock]:
        clocks = [self.clock]
        if self._feature_kernels is not None:
            clocks.append(self._feature_kernels.clock)
        for stage, _ in self._tensors:
            clocks += getattr(stage, "clocks", [])
        return clocks

    # -- work --------------------------------------------------------------------------
    @property
    def pass_counts(self) -> tuple[int, int, int]:
        """Launches per slab along axes 2, 1 and 0: distinct axis-2 factors, distinct
        (axis-2, axis-1) pairs, distinct terms (fused: the tables' roots, mids and combos)."""
        if not self._slots:
            return 0, 0, 0
        return self._passes.counts  # fused: the tables' sizes (one launch)

    @property
    def engines(self) -> list[str]:
        """The paths taken: 'separable' for the passes, then each direct engine ('fp32',
        'tensor-int8')."""
        direct = sorted({c.engine for c in self._direct})
        return (["separable"] if self._slots else []) + direct

    @property
    def tensor_gflop(self) -> float:
        """GFLOP the tensor cores execute for one volume (0 without a tensor-core group)."""
        return sum(c.tensor_gflop for c in self._direct)

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
        return self._passes.work(self.slabs())


def convolve_separable(
    volume: np.ndarray,
    filters: object,
    mode: str = "reflect",
    cval: float = 0.0,
    *,
    device: cl.Device | str | None = None,
    features: Sequence[Feature] = (),
    **options: object,
) -> np.ndarray:
    """Apply a bank (each filter exactly as scipy.ndimage.convolve applies it) through
    `SeparableConvolver`; a 4D volume is filtered as t independent 3D volumes.

    ``features`` (`volconv.bank.features.Feature`s; ``filters`` then a list of `Filter`s, possibly
    empty) adds their outputs after the bank's responses (`volconv.bank.features.expand`).

    Returns
    -------
    (N, *volume.shape) float32 array
    """
    if not isinstance(volume, np.ndarray):
        raise TypeError(f"volume must be a numpy array; got {type(volume).__name__}")
    check_volume_dtype(volume.dtype)
    if volume.ndim not in (3, 4):
        raise ValueError(f"volume must be 3D or 4D; got shape {volume.shape}")
    if features:
        expanded = expand(list(filters), features)
        filters, options = expanded.filters, {**options, "expanded": expanded}
    conv = SeparableConvolver(
        filters, volume.shape[:3], volume.dtype, mode, cval, device=device, **options
    )
    out = np.empty((conv.plan.n_outputs, *volume.shape), np.float32)
    frames = [volume] if volume.ndim == 3 else [volume[..., t] for t in range(volume.shape[3])]
    for t, frame in enumerate(frames):
        for a, b in conv.slabs():
            rows = frame[conv.source_rows(a, b)]
            if volume.ndim == 3:
                conv.convolve_slab(a, b, rows, out[:, a:b])
            else:
                out[:, a:b, ..., t] = conv.convolve_slab(a, b, rows)
    return out

"""The separable plan: each filter's path (direct kernel, separable passes, a low-rank sum) by a
cost model (`plan_bank`, `plan_paths`: `Choice`), the fused kernel where a GPU's tree fits it
(`fused_fits`), and the plan of a bank at a shape, type and mode (`make_separable_plan`:
`SeparablePlan`, with its direct groups' plans and the slab depth), made once and handed to
`volconv.engines.separable.SeparableConvolver`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyopencl as cl

from volconv.bank.factor import Term, factorise, reconstruction_ok
from volconv.bank.filters import Filter
from volconv.bank.spec import MAX_EXTENT
from volconv.checks import check_cval, check_mode
from volconv.engines.boundary import halo
from volconv.engines.choose import direct_plan
from volconv.engines.columns import COLUMN_SHAPE, columns_fits
from volconv.engines.direct import (
    check_volume_dtype,
)
from volconv.engines.padder import native_volume
from volconv.engines.passes import MID_ROWS, FusedTree, fused_tree
from volconv.engines.tree import tree_bytes
from volconv.engines.xfirst import XFIRST_SHAPE, reversed_tree, xfirst_bytes
from volconv.plan.direct import (
    MAX_SEPARABLE_EXTENT,
    MAX_SEPARABLE_FILTERS,
    Plan,
    pad_dtype_for,
    streaming_depth,
)
from volconv.plan.trees import (
    MAX_TREE_VALUES,
    TREE_SHAPE,
    multi_fits,
    xfirst_fits,
    xfirst_over_fused,
)

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
# ... and for a bank with device features (its epilogue per output row: longer runs of rows
# pay; benchmarks/results/h100-feature-sweep-*.json, the Hessian at sigma 1)
FEATURES_TILE: tuple[int, int, int] | None = (8, 16, 64)
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
        if fused_fits(fused_tree(choices, lo), tile or FUSED_TILE, device, forced=bool(fused)):
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
    multi: bool = False  # the pass tree as three multi-output launches (kernels/tree.cl)
    xfirst: bool = False  # ... as two, axis 0 first (kernels/tree_yz.cl)
    columns: bool = False  # one kernel on a CPU (kernels/columns.cl)

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
        if self.fused or self.columns:  # no intermediates
            del sizes["fast"], sizes["mid"]
        if self.columns:  # its last row's loads (chunks of V) reach past the row: slack
            sizes["padded"] += COLUMN_SHAPE["V"] * self.pad_dtype.itemsize
        elif self.xfirst:  # the roots along axis 0 of a block of rows
            sizes["fast"] = xfirst_bytes(self, reversed_tree(self.choices, self.halo_lo), depth)
            sizes["mid"] = 0
        elif self.multi:  # every root's and every mid's rows at once
            sizes.update(tree_bytes(self, fused_tree(self.choices, self.halo_lo), depth))
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
    stage_halo: int = 0,
    engine: str | None = None,
    multi: bool | None = None,
    xfirst: bool | None = None,
    columns: bool | None = None,
    **overrides: object,
) -> SeparablePlan:
    """Plan a bank on the separable path without building anything (``volconv validate``):
    the paths (`plan_bank` unless ``choices`` are given), the common halo, the direct groups
    and the deepest slab whose buffers fit ``memory_budget`` (default: a quarter of the
    device's memory, at most 2 GiB) and the device's largest allocation; ``stream`` caps it
    so that reading, computing and writing overlap, as `volconv.plan.direct.make_plan` does,
    but not below twice the rows a slab computes again (the halo along axis 0, and
    ``stage_halo``: a structure tensor's gradients and products over its outer reach on both
    sides), so that at most a third of the rows a slab computes are another slab's.

    ``fused`` (default: on GPUs) runs the separable filters in one kernel when their tree fits
    it (`fused_fits`); else, or when it is False, as the pass tree (the paths, if not given,
    by `plan_paths`). True where the tree does not fit is an error.

    ``multi`` (default: on GPUs for a bank with device features, where `multi_fits`) runs
    the pass tree (not fused) as three multi-output launches, kernels/tree.cl; True forces it
    where the tree fits its registers;
    ``xfirst`` (default: where multi runs and its tiles fit local memory) as two, axis 0 first
    (kernels/tree_yz.cl), a block of ``block_rows`` rows at a time (default: its own).

    ``columns`` (default: on CPUs for a bank with device features, where
    `volconv.engines.columns.columns_fits`) runs the tree (neither fused nor multi) in one
    kernel for CPUs, kernels/columns.cl; True forces it."""
    entries = _entries(filters)
    mode, cval = check_mode(mode), check_cval(cval)
    check_volume_dtype(dtype)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"volume must be 3D and non-empty; got shape {tuple(shape)}")
    kind = device_kind(device)
    given = (vector_width, rows)
    vector_width = PASS_SHAPE[kind][0] if vector_width is None else vector_width
    rows = PASS_SHAPE[kind][1] if rows is None else rows
    if vector_width not in (1, 2, 4, 8, 16):
        raise ValueError(f"vector_width must be 1, 2, 4, 8 or 16; got {vector_width}")
    if tile is None:
        tile = FEATURES_TILE if feature_planes and FEATURES_TILE else FUSED_TILE
    tile = tuple(int(t) for t in tile)
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
    if want and fused is None and xfirst is not False:  # small banks of features: axis 0 first
        want = not xfirst_over_fused(tree, choices, lo, feature_planes, device)
    if want and not fused_fits(tree, tile, device, forced=bool(fused)):
        if fused:
            raise ValueError(
                f"fused: the bank's separable filters do not fit the fused kernel (at most "
                f"{MAX_FUSED_VALUES} responses x axis-0 taps + distinct (axis-2, axis-1) "
                f"pairs, and its tiles in local memory)"
            )
        want = False
    # by default a bank whose features the device computes, on GPUs (the others' paths as
    # measured before these trees)
    default_multi = kind == "gpu" and feature_planes > 0
    # kernels/tree.cl's own shape, unless given
    v_tree, u_tree = (t if g is None else g for t, g in zip(TREE_SHAPE[kind], given, strict=True))
    several = not want and (
        multi_fits(tree, choices, int(u_tree), v_tree, forced=bool(multi or xfirst))
        if (default_multi or bool(xfirst) if multi is None else multi)
        else False
    )
    if several:
        vector_width, rows = v_tree, u_tree
    first = (several and xfirst is not False
             and xfirst_fits(reversed_tree(choices, lo), device))  # fmt: skip
    if xfirst and not first and not want:
        raise ValueError("xfirst: the bank's pass tree does not fit kernels/tree_yz.cl")
    if first and not block_rows:
        block_rows = XFIRST_SHAPE[kind]["BLOCK"]
    # by default for a bank whose features the device computes, on CPUs (its program is
    # built per bank: the taps are immediate operands)
    if columns is None:
        columns = kind == "cpu" and feature_planes > 0 and columns_fits(tree)
    in_columns = not want and not several and bool(columns)
    if in_columns:
        if tree is None:
            raise ValueError("columns: the bank has no separable filter")
        vector_width = max(vector_width, COLUMN_SHAPE["V"])
    if multi and not several and not want:
        raise ValueError(f"multi: the bank's pass tree does not fit kernels/tree.cl (at most "
                         f"{MAX_TREE_VALUES} responses x rows x lanes)")  # fmt: skip
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
        want, tile, n_stored, int(feature_planes), int(n_tensor), tuple(plans), several, first,
        in_columns,
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
        if stream:  # twice what is computed again: wide filters would redo a slab's rows
            redone = lo[0] + hi[0] + stage_halo
            streamed = streaming_depth(shape[0], shape[1] * shape[2])
            slab_depth = min(slab_depth, max(streamed, 2 * redone))
    return replace(plan, slab_depth=max(1, min(int(slab_depth), shape[0])))


def fused_fits(
    tree: FusedTree | None, tile: tuple[int, int, int], device: cl.Device, forced: bool = True
) -> bool:
    """Whether the fused kernel can run ``tree``: its values in registers, its tiles (two of
    each) in the device's local memory; and, unless ``forced``, whether it pays by default (no
    window longer than `MAX_FUSED_TAPS`)."""
    if tree is None or (not forced and max(tree.taps) > MAX_FUSED_TAPS):
        return False
    ty, tz, _ = tile
    tile_y = ty + tree.taps[1] - 1
    local = 2 * (tile_y * (tz + tree.taps[2] - 1) + len(tree.wz) * tile_y * tz) * 4
    return (
        tree.values <= MAX_FUSED_VALUES
        and local <= device.local_mem_size
        and ty * tz <= device.max_work_group_size
    )

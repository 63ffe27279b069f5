"""The separable path: a bank as 1D passes shared across its filters, each at its own extent.

`volconv.plan.separable` chooses per filter between the direct kernel and separable passes by a
cost model and plans the bank once; `SeparableConvolver` has `BankConvolver`'s slab interface
and computes every response of the bank: the separable filters by 1D passes
(kernels/separable.cl), the others by direct convolvers grouped by their own extent, never
padded to the widest.

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
rest, and kernels/features.cl computes the features after it. Both are in
`volconv.engines.passes`. On CPUs a tree that fits runs as one kernel too, kernels/columns.cl
(`volconv.engines.columns`): no local memory, vectors along axis 2, the mids of the last planes
in a ring in the core's cache, the features its epilogue.

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
from dataclasses import replace

import numpy as np
import pyopencl as cl

from volconv.bank.features import DeviceFeature, Expanded, Feature, expand
from volconv.bank.filters import stack_kernels
from volconv.bank.spec import MAX_EXTENT
from volconv.device.devices import select_device
from volconv.device.programs import context_for, device_seconds
from volconv.engines.boundary import extend_indices, halo, sources
from volconv.engines.choose import convolver_for
from volconv.engines.clock import KernelClock, merged
from volconv.engines.columns import ColumnKernel
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
from volconv.engines.padder import Padder, frame_bytes, slab_rows
from volconv.engines.passes import FusedKernel, PassTree, fused_tree
from volconv.engines.scales import PresetStage
from volconv.engines.tree import MultiTree
from volconv.engines.xfirst import XFirstTree, reversed_tree
from volconv.plan.separable import (
    BLOCK_ROWS,
    Choice,
    SeparablePlan,
    _entries,
    make_separable_plan,
    plan_paths,
)
from volconv.report import work_gflop


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
    columns
        On CPUs, the pass tree as one kernel, kernels/columns.cl (default: where it fits; see
        `make_separable_plan`).
    multi, xfirst
        The pass tree as three multi-output launches with the features as their epilogue
        (default: on GPUs, where it pays), or as two with axis 0 first (default: where multi
        runs and its tiles fit); see `make_separable_plan`.
    engine : {'auto', 'fp32', 'tensor'}, optional
        The direct groups' engine (`volconv.engines.choose.direct_convolver`; default
        $VOLCONV_ENGINE or 'auto': the tensor cores where the device and bank allow).
    expanded : volconv.bank.features.Expanded, optional
        Derived features: ``filters`` is then ``expanded.filters`` (the bank's, then those
        only features read), the first ``expanded.n_stored`` responses are given, then each
        feature's outputs (`plan.n_outputs` volumes in all). The filters the device features
        read must be on the separable path (`plan_paths`' ``separable``).
    zero_skip : bool, optional
        The fused kernel skips the planes of a zero background where the device allows
        (`volconv.engines.passes.FUSED_FLAT`; default: where the bank feeds device features).
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
        multi: bool | None = None,
        xfirst: bool | None = None,
        columns: bool | None = None,
        zero_skip: bool | None = None,
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
                rows=rows, block_rows=block_rows, fused=fused, tile=tile, engine=engine,
                multi=multi, xfirst=xfirst, columns=columns, **sizes, **overrides,
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
        self._zero_skip = bool(self._features) if zero_skip is None else zero_skip
        self._feature_kernels: FeatureKernels | None = None
        self._tensors: list[tuple[StructureTensorStage | PresetStage, tuple[int, ...]]] = []
        if expanded is not None and (self._features or expanded.tensors or expanded.presets):
            self._feature_kernels = FeatureKernels(self.ctx, self.queue)
            for feat, at in expanded.tensors:
                stage = StructureTensorStage(
                    feat, plan.shape, dtype, plan.mode, plan.cval, self.device,
                    plan.slab_depth, self._feature_kernels, fused=fused, multi=multi,
                    xfirst=xfirst,
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
        n_stored = sum(f < plan.stored for f in self._slots)
        if plan.fused:
            self._passes = FusedKernel(ctx, self.queue, plan, self._tree, self._epilogue(),
                                       n_stored, plan.feature_planes, self.clock,
                                       self._zero_skip)  # fmt: skip
        elif plan.xfirst:
            self._passes = XFirstTree(ctx, self.queue, plan, reversed_tree(plan.choices, lo),
                                      self._epilogue(), n_stored, plan.feature_planes,
                                      self.clock)  # fmt: skip
        elif plan.multi:
            self._passes = MultiTree(ctx, self.queue, plan, self._tree, self._epilogue(),
                                     n_stored, plan.feature_planes, self.clock)  # fmt: skip
        elif plan.columns:
            self._passes = ColumnKernel(ctx, self.queue, plan, self._tree, self._epilogue(),
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
        if self.plan.fused or self.plan.multi or self.plan.columns:
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
        feat = self._feat if self._features else self._out
        if self.plan.fused:
            return [self._passes.launch(self._padded, self._out, feat, depth, every)]
        if self.plan.multi:
            return self._passes.launch(self._padded, self._out, feat, depth, every)
        if self.plan.columns:
            return self._passes.launch(self._padded, self._out, depth, feat=feat, every=every)
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
        """Useful GFLOP of one volume (`volconv.report.work_gflop`): 2 * voxels *
        sum_k prod(extent_k) over each filter's own extent, the features' included
        (`Expanded.work_extents`)."""
        extents = (self.expanded.work_extents if self.expanded is not None
                   else [k.shape for k in self.kernels])  # fmt: skip
        return work_gflop(extents, math.prod(self.plan.shape))

    @property
    def executed_gflop(self) -> float:
        """GFLOP the kernels compute for one volume: the passes' taps over every output they
        produce (halo rows and the row tail included), the coefficient multiply-adds, the
        direct groups' taps, a structure tensor's passes and a preset's first stage (its
        smoothing; its stencils uncounted)."""
        return (self._work()[0] / 1e9 + sum(c.executed_gflop for c in self._direct)
                + sum(stage.executed_gflop for stage, _ in self._tensors))  # fmt: skip

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

"""volconv.plan.direct: pass splitting, unroll and work-group choices and slab depth under budgets,
as pure functions of a device's limits (a stand-in device: no OpenCL needed)."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pyopencl as cl
import pytest

from volconv.plan.direct import (
    MAX_UNROLLED_FMAS,
    MIN_STREAM_DEPTH,
    MIN_STREAM_VOXELS,
    STREAM_SLABS,
    make_plan,
    pad_dtype_for,
    split_passes,
)
from volconv.plan.knobs import VECTOR_WIDTHS

GiB = 2**30


def fake_device(*, gpu: bool = True, memory: int = 80 * GiB, alloc: int = 20 * GiB,
                local: int = 48 * 1024, group: int = 1024) -> SimpleNamespace:  # fmt: skip
    kind = cl.device_type.GPU if gpu else cl.device_type.CPU
    return SimpleNamespace(type=kind, global_mem_size=memory, max_mem_alloc_size=alloc,
                           local_mem_size=local, max_work_group_size=group)  # fmt: skip


def plan(shape=(256, 256, 256), extents=(7, 7, 7), n=8, device=None, **knobs):
    return make_plan(shape, np.dtype(np.uint8), extents, n, "reflect", 0.0,
                     device or fake_device(), **knobs)  # fmt: skip


@pytest.mark.parametrize("n", range(1, 65))
def test_passes_cover_every_filter_once(n):
    passes = split_passes(n)
    assert sum(p.count for p in passes) == n
    assert [p.first for p in passes] == [
        sum(q.count for q in passes[:i]) for i in range(len(passes))
    ]
    assert all(p.width in VECTOR_WIDTHS and 1 <= p.count <= p.width for p in passes)


def test_passes_prefer_wide_vectors_and_no_wasted_lanes():
    assert [p.width for p in split_passes(8)] == [8]
    assert [p.width for p in split_passes(13)] == [8, 4, 1]
    assert [p.width for p in split_passes(16)] == [8, 8]  # width 16 measured slower
    assert [p.width for p in split_passes(5, width=4)] == [4, 4]  # forced width: one spare lane


def test_cpus_split_banks_by_their_own_pass_costs():
    """On a CPU a pass of width 4 costs what one of 8 costs: 13 filters run as 8 + 8."""

    def widths(n, gpu):
        return [p.width for p in plan(n=n, device=fake_device(gpu=gpu)).passes]

    assert widths(13, gpu=True) == [8, 4, 1] and widths(13, gpu=False) == [8, 8]
    assert widths(8, gpu=False) == [8] and widths(4, gpu=False) == [4]
    assert widths(2, gpu=False) == [2] and widths(5, gpu=False) == [8]


def test_unroll_and_work_group_by_device_kind():
    gpu, cpu = plan(device=fake_device()), plan(device=fake_device(gpu=False))
    assert gpu.unroll == 8 and cpu.unroll == 16
    assert gpu.local_size == (32, 4, 1)
    small = plan(device=fake_device(group=64))
    assert math.prod(small.local_size) <= 64


def test_gpus_block_narrow_vectors_in_two_axes_within_the_code_budget():
    """Narrow vectors take several output rows per work-item on a GPU while the loop over
    input rows unrolled whole stays within `MAX_UNROLLED_FMAS`; past it width 1 keeps its
    block with the loop over filter rows (``roll``, unrolled ``rows`` times), wider vectors
    take fewer rows. CPUs keep one row."""
    one = plan(n=1)
    assert (one.unroll, one.rows, one.row_unroll, one.roll) == (8, 4, None, False)
    assert plan(n=1, device=fake_device(gpu=False)).rows == 1
    for k in (3, 5, 7, 9, 11, 31):
        for n in (1, 2, 4, 8):
            p = plan(extents=(k, k, k), n=n)
            for q in p.passes:
                b = p.block(q)
                over = b.rows * b.unroll * k * k * q.width > MAX_UNROLLED_FMAS
                assert b.rows == 1 or b.roll == over
                assert not (b.roll and b.rows > 1) or (q.width == 1 and b.row_unroll == b.rows)
    big = plan(extents=(11, 11, 11), n=1)
    assert (big.unroll, big.rows, big.row_unroll, big.roll) == (8, 4, 4, True)
    wide = plan(extents=(11, 11, 11), n=4)
    assert (wide.unroll, wide.rows, wide.roll) == (16, 1, False)  # one row at its best unroll
    assert plan(extents=(11, 11, 11), n=1, rows=3).rows == 3  # a given knob is kept
    assert plan(shape=(4, 2, 40), n=1).rows == 2  # no more rows than the volume has
    cpu = plan(extents=(11, 11, 11), n=1, device=fake_device(gpu=False), unroll=8, rows=4)
    assert cpu.roll and cpu.rows == 4  # rows given past the budget: the rolled loop


@pytest.mark.parametrize(
    ("k", "roll", "row_unroll"), [(3, True, 1), (5, False, 2), (7, False, 2), (9, False, None)]
)
def test_gpus_run_one_row_of_wide_vectors_by_the_filters_extent(k, roll, row_unroll):
    """Width 8, one row: over filter rows at 3^3, over input rows unrolled twice at 5^3-7^3,
    the compiler's unroll from 9^3 (as measured on the H100)."""
    p = plan(extents=(k, k, k), n=8)
    assert (p.rows, p.roll, p.row_unroll) == (1, roll, row_unroll)


def test_each_pass_takes_its_own_widths_block_unless_knobs_are_given():
    """Untuned, a pass narrower than the widest runs the block its width ran best at; given
    knobs (or tuned ones) hold for every pass. P2 covers every pass's unrolled reads."""
    p = plan(n=13)
    blocks = [(q.width, p.block(q).unroll, p.block(q).rows) for q in p.passes]
    assert blocks == [(8, 8, 1), (4, 4, 2), (1, 8, 4)]
    assert p.passes[0].block is None and p.block(p.passes[0]) == p.block()
    given = plan(n=13, unroll=8)
    assert all(given.block(q) == given.block() for q in given.passes)
    odd = plan(shape=(20, 30, 37), n=13)
    reads = [math.ceil(37 / odd.block(q).unroll) * odd.block(q).unroll for q in odd.passes]
    assert odd.padded_yz[1] == math.ceil((max(reads) + 6) / 4) * 4  # a pass stages tiles
    assert plan(shape=(20, 30, 37), n=13, extents=(5, 5, 5)).padded_yz[1] == max(reads) + 4


@pytest.mark.parametrize(
    ("k", "n", "tiles"),
    [(7, 2, [2]), (7, 4, [2]), (7, 8, [0]), (7, 1, [0]), (7, 13, [0, 2, 0]), (9, 2, [2]),
     (9, 4, [0]), (5, 4, [0]), (11, 2, [0])],
)  # fmt: skip
def test_gpus_stage_input_tiles_where_they_ran_faster(k, n, tiles):
    """Two input tiles in local memory for passes of width 2 and 4 at unroll 4 from kz 7 on
    (as measured on the H100); never on a CPU; P2 then a multiple of 4 (4 values a load)."""
    p = plan(extents=(k, k, k), n=n)
    assert [p.block(q).input_local for q in p.passes] == tiles
    assert p.padded_yz[1] % 4 == 0 or not any(tiles)
    assert not plan(extents=(k, k, k), n=n, device=fake_device(gpu=False)).input_local
    if any(tiles):
        assert plan(extents=(k, k, k), n=n, input_local=False).passes == tuple(
            replace(q, block=q.block and replace(q.block, input_local=0)) for q in p.passes
        )


def test_input_tiles_when_asked_and_where_they_fit():
    """input_local=True: two tiles where they fit beside the coefficients, else one; a
    ValueError naming the knob where none fits or the unroll is not a multiple of 4."""
    wide = plan(n=8, input_local=True)
    assert wide.input_local == 2 and wide.build_options(wide.passes[0])["INPUT_LOCAL"] == 2
    assert wide.build_options(wide.passes[0])["LZ"] == 32
    assert plan(n=1, input_local=True).input_local == 1  # 8 x 4 rows: 26 KB a tile
    with pytest.raises(ValueError, match="input_local: needs an unroll that is a multiple of 4"):
        plan(n=8, input_local=True, unroll=6)
    device = fake_device()
    device.name = "GPU "
    with pytest.raises(ValueError, match=r"input_local: the input tiles .* take .* GPU has"):
        plan(n=1, input_local=True, rows=8, local_size=(32, 8), device=device)
    assert "INPUT_LOCAL" not in plan(n=8).build_options(plan(n=8).passes[0])


def test_cpus_pad_the_slab_as_float32():
    u8 = np.dtype(np.uint8)
    assert plan(device=fake_device(gpu=False)).pad_dtype == np.float32
    assert plan(device=fake_device()).pad_dtype == u8
    assert plan(device=fake_device(gpu=False), pad_float=False).pad_dtype == u8
    assert plan(device=fake_device(), pad_float=True).pad_dtype == np.float32
    assert pad_dtype_for(u8, "reflect", 0.0, pad_float=True) == np.float32


def test_slab_depth_fits_the_memory_budget():
    whole = plan()
    assert whole.slab_depth == 256  # 80 GiB holds it all (budget 2 GiB)
    budget = 64 * 2**20
    p = plan(memory_budget=budget)
    assert p.device_bytes <= budget < plan(slab_depth=p.slab_depth + 1).device_bytes
    assert p.n_slabs == math.ceil(256 / p.slab_depth)


def test_slab_depth_respects_one_allocation():
    p = plan(device=fake_device(alloc=100 * 2**20))
    assert max(p.slab_bytes(p.slab_depth).values()) <= 100 * 2**20


def test_no_slab_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="memory_budget"):
        plan(memory_budget=1000)


def test_streaming_plans_several_slabs_per_frame():
    p = plan(stream=True)
    assert p.slab_depth == max(MIN_STREAM_DEPTH, math.ceil(256 / STREAM_SLABS))
    assert plan(shape=(20, 64, 64), stream=True).slab_depth == 20  # shallow: one slab
    assert plan(shape=(128, 128, 128), stream=True).slab_depth == 128  # small: one slab
    assert plan(shape=(200, 128, 128), stream=True).slab_depth == MIN_STREAM_VOXELS // 128**2
    assert plan(stream=True, slab_depth=7).slab_depth == 7  # forced depth wins


def test_padded_type_holds_cval():
    u8 = np.dtype(np.uint8)
    assert pad_dtype_for(u8, "constant", 255.0) == u8
    assert pad_dtype_for(u8, "constant", 0.5) == np.float32
    assert pad_dtype_for(u8, "constant", -1.0) == np.float32
    assert pad_dtype_for(u8, "reflect", 0.5) == u8  # cval unused


def test_padded_yz_covers_the_last_unrolled_reads():
    p = plan(shape=(10, 11, 13), extents=(3, 5, 7))
    p1, p2 = p.padded_yz
    assert p1 == 11 + 4
    assert p2 >= math.ceil(13 / p.unroll) * p.unroll + 6


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"unroll": 0}, "unroll must be a positive integer; got 0"),
        ({"unroll": 2.5}, "unroll must be a positive integer; got 2.5"),
        ({"vector_width": 3}, r"vector_width must be one of \(1, 2, 4, 8, 16\); got 3"),
        ({"local_size": 5}, "local_size must be two positive integers; got 5"),
        ({"rows": 0}, "rows must be a positive integer; got 0"),
        ({"rows": 9}, "rows must be 1..8; got 9"),
        ({"local_size": (0, 4)}, "local_size must be a positive integer; got 0"),
        ({"local_size": (64, 32)}, r"local_size \(64, 32\) has 2048 work-items; GPU takes at most"),
    ],
)
def test_expert_knobs_are_checked_by_name(knobs, message):
    """The API's knobs fail with a ValueError naming them, not deep inside the build."""
    device = fake_device()
    device.name = "GPU "
    with pytest.raises(ValueError, match=message):
        plan(device=device, **knobs)

"""The model that sizes a local batch (volconv.run.batch): how many worker processes start
besides the command's own (`workers_for`) and how many filter on each device
(`processes_for`: the user's count, else `processes_per_device`).

What one input costs on one device is the model's estimate (`input_costs`: a fixed share of
host work, the output's bytes at one writer's rate on a local disk, the filtering at a
fraction of the device's peak) times this machine's pace: its measured over its modelled
seconds per input in its last run of two or more inputs in one process (`remember_pace`,
`pace`). What workers cost is the seconds until they are ready, as this machine's last batch
measured them (`start_cost`), and what they cost the command's own process meanwhile
(`pool_cost`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING

import numpy as np

from volconv.config import Config, PipelineError
from volconv.device.cache import cache_folder, read_cached, write_cached
from volconv.run.spawn import CORES_PER_PROCESS

if TYPE_CHECKING:
    from volconv.report import VolumeReport
    from volconv.run.jobs import Job

# What starting the workers costs until this machine has measured it, and what one input
# costs on one device until this machine has measured its pace.
WORKER_START_SECONDS = 1.0
INPUT_SECONDS = 0.03
WRITE_BYTES_PER_SECOND = 2e9
PEAK_SHARE = 0.3
# What starting workers costs the command's own process besides their wait: planning the
# first input for them, feeding them, sharing the host and the devices while they start (the
# command less its run, with workers against one device: benchmarks/README.md, "Batches";
# spawning them is off its path since they start with the command: volconv.run.spawn).
POOL_SECONDS = 0.15
# Worker processes per device: more where the host, not the device, is what limits, as many
# as the host's cores carry (each process filters one input while it writes another).
PROCESSES_ENV = "VOLCONV_PROCESSES_PER_DEVICE"
MAX_PROCESSES_PER_DEVICE = 2
# The start cost the model assumes, in seconds, over the measured one and `POOL_SECONDS`
# (0: always workers).
START_ENV = "VOLCONV_WORKER_START_SECONDS"
# In the cache folder (volconv.device.cache: its trust rule).
START_FILE = "batch_start.json"
PACE_FILE = "batch_pace.json"


def modelled_costs(
    voxels: int, outputs: int, itemsize: int, gflop: float, peak_gflops: float | None
) -> tuple[float, float]:
    """What one input costs on one device by the model alone: (seconds of host work and
    filtering, seconds of writing its output)."""
    work = INPUT_SECONDS + (gflop / (PEAK_SHARE * peak_gflops) if peak_gflops else 0.0)
    return work, voxels * outputs * itemsize / WRITE_BYTES_PER_SECOND


def input_costs(job: Job, cfg: Config, peak_gflops: float | None) -> tuple[float, float]:
    """``job``'s `modelled_costs`."""
    voxels = math.prod(int(s) for s in job.volume.shape)
    itemsize = np.dtype(cfg.dtype).itemsize
    return modelled_costs(voxels, len(job.outputs), itemsize, job.gflop, peak_gflops)


def input_seconds(job: Job, cfg: Config, peak_gflops: float | None, pace: float = 1.0) -> float:
    """What one input costs on one device (`workers_for`): the model's seconds times this
    machine's ``pace``."""
    return sum(input_costs(job, cfg, peak_gflops)) * pace


def processes_per_device(work: float, write: float, devices: int, cpus: int) -> int:
    """How many processes filter on each device: one where an input's device-side ``work``
    takes as long as its ``write`` or longer (the device limits: a second process would only
    wait for it); where the writing takes longer (the host limits: a process filters its next
    input while it writes one, so its device waits), `MAX_PROCESSES_PER_DEVICE`, as far as
    the host's ``cpus`` give each process `CORES_PER_PROCESS` cores."""
    if write <= work:
        return 1
    return max(1, min(MAX_PROCESSES_PER_DEVICE, cpus // (CORES_PER_PROCESS * max(1, devices))))


def processes_asked() -> int | None:
    """``$VOLCONV_PROCESSES_PER_DEVICE``, where set (a `PipelineError` where it is wrong)."""
    text = os.environ.get(PROCESSES_ENV)
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise PipelineError(f"{PROCESSES_ENV}={text!r}: give a whole number of 1 or more")
    return int(text)


def processes_for(cfg: Config, devices: tuple[str, ...], job: Job,
                  peak_gflops: float | None) -> int:  # fmt: skip
    """Processes per device for inputs like ``job``: ``$VOLCONV_PROCESSES_PER_DEVICE``, else
    `processes_per_device` by the model's costs of ``job``."""
    per = processes_asked()
    if per is None:
        work, write = input_costs(job, cfg, peak_gflops)
        per = processes_per_device(work, write, len(devices), os.cpu_count() or 1)
    return per


def workers_for(seconds: list[float], devices: int, start: float | Sequence[float],
                pool: float = 0.0) -> int:  # fmt: skip
    """How many local worker processes a batch of inputs costing ``seconds`` each on one
    device should start besides this process, which filters on the first device from the
    start, when they are ready ``start`` seconds from now (each worker's, in the order they
    are taken, where a sequence: those started early first) and cost this process ``pool``
    seconds: the count whose batch ends first (this process's share of the work from time
    0, each worker's from its start: the sum plus the starts, shared out; at least the
    largest input; plus ``pool``), or 0 where no count ends before this process alone would
    (the sum of ``seconds``) -- so a batch is never slower than one device by the model."""
    starts = [start] if isinstance(start, int | float) else list(start) or [0.0]
    best, best_seconds, begun = 0, sum(seconds), 0.0
    for w in range(1, min(devices, len(seconds))):
        begun += max(0.0, starts[min(w, len(starts)) - 1])
        ends = max(max(seconds), (sum(seconds) + begun) / (w + 1)) + pool
        if ends < best_seconds:
            best, best_seconds = w, ends
    return best


def _cached_number(name: str, key: str, low: float, high: float, then: str) -> float | None:
    """``key`` of the JSON cached as ``name``, where it is a number in [low, high)."""
    try:
        data = read_cached(cache_folder(), name, then)
        value = float(json.loads(data)[key]) if data and len(data) < 4096 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if value is not None and math.isfinite(value) and low <= value < high else None


def _remember(name: str, key: str, value: float) -> None:
    with suppress(OSError):  # a read-only cache: the next batch assumes the default
        write_cached(cache_folder(), name, json.dumps({key: round(value, 3)}).encode())


def start_cost() -> float:
    """Seconds until local workers are ready: ``$VOLCONV_WORKER_START_SECONDS``, else what
    this machine's last batch measured (cached), else `WORKER_START_SECONDS`."""
    if (text := os.environ.get(START_ENV)) is not None:
        try:
            return max(0.0, float(text))
        except ValueError:
            raise PipelineError(f"{START_ENV}={text!r}: give seconds, e.g. 1.5") from None
    value = _cached_number(START_FILE, "ready_seconds", 0, 600, "the default start cost applies")
    return WORKER_START_SECONDS if value is None else value


def pool_cost() -> float:
    """What workers cost this process besides their wait: `POOL_SECONDS`, or nothing where
    ``$VOLCONV_WORKER_START_SECONDS`` gives the whole start cost."""
    return 0.0 if START_ENV in os.environ else POOL_SECONDS


def remember_start(seconds: float) -> None:
    """Keep a batch's measured ready time as this machine's `start_cost`."""
    _remember(START_FILE, "ready_seconds", seconds)


def pace() -> float:
    """This machine's measured over modelled seconds per input (`remember_pace`); 1 until
    measured."""
    value = _cached_number(PACE_FILE, "pace", 0.01, 100, "the model's own pace applies")
    return 1.0 if value is None else value


def remember_pace(cfg: Config, reports: Sequence[VolumeReport], seconds: float,
                  peak_gflops: float | None) -> None:  # fmt: skip
    """After a run of ``cfg`` in one process alone (one device, or a batch too small for
    workers) that took ``seconds``: keep its seconds per input over the model's as this
    machine's `pace`, where it filtered two or more inputs (one input's run is mostly its
    start, not its pace)."""
    done = [r for r in reports if r.status == "done"]
    if len(done) < 2 or not seconds > 0:
        return
    itemsize = np.dtype(cfg.dtype).itemsize
    modelled = sum(
        sum(modelled_costs(math.prod(r.shape), r.n_filters, itemsize,
                           r.gflop if math.isfinite(r.gflop) else 0.0, peak_gflops))
        for r in done
    )  # fmt: skip
    if modelled > 0:
        _remember(PACE_FILE, "pace", min(max(seconds / modelled, 0.01), 99.0))

"""Batches on Dask distributed: an existing scheduler (``--scheduler ADDRESS``, or the
scheduler of a dask-jobqueue ``SLURMCluster``, `slurm_cluster`) whose workers each own one
device.

The client plans and checks the whole pipeline (a user's mistake exits 2 before any task),
connects within `connect_seconds` (a wrong address is said in one line), skips complete
outputs and submits one task (`volconv.run.workers.process`) per other input, largest first.
Every record is gathered: done, skipped or failed. Tasks are safe to run twice: an output is
written under a temporary name and renamed when complete, so the scheduler's rerun of a task
whose worker died is correct by construction.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from volconv.config import Config, PipelineError
from volconv.report import VolumeReport
from volconv.run.batch import BatchResult, OnPlan, OnVolume, Say, skip_complete, to_run
from volconv.run.interrupts import Interrupted
from volconv.run.jobs import Job, choose_device, plan_jobs
from volconv.run.pool import RETRIES, STOP_WAIT, task_record
from volconv.run.spawn import DEVICE_ENV
from volconv.run.workers import describe, process, stop

if TYPE_CHECKING:
    from distributed import Client

# Every task holds one "GPU" of its worker: a worker started with --resources GPU=2 and two
# threads filters one input while the one before is written; with GPU=1, one at a time.
RESOURCES = {"GPU": 1}
# A scheduler that has not answered within this many seconds is taken as not there (Dask's
# own connect can wait forever on a port that accepts and never answers).
CONNECT_SECONDS = 10.0


def remote_batch(
    cfg: Config,
    overwrite: bool,
    report: str | Path | None,
    on_plan: OnPlan,
    on_volume: OnVolume,
    say: Say,
) -> BatchResult:
    # The client plans on any device, only to check: each worker plans again for its own.
    jobs = plan_jobs(cfg, choose_device(cfg), overwrite=overwrite, report=report)
    result = BatchResult(workers=[], scheduler=cfg.scheduler)
    start = time.perf_counter()
    with ExitStack() as stack:
        # a wrong address is found before any work (exit 2): connect first, then begin
        client = stack.enter_context(connect(cfg)) if to_run(jobs, overwrite) else None
        if on_plan:
            on_plan(jobs)
        records = skip_complete(jobs, overwrite, on_volume)
        todo = sorted((j for j in jobs if j.spec not in records), key=lambda j: -j.gflop)
        if client is not None:
            result.workers = _remote_workers(client, cfg, say)
            result.start_seconds = time.perf_counter() - start
            _gather(client, cfg, todo, records, overwrite, on_volume)
            result.seconds = time.perf_counter() - start - result.start_seconds
    result.reports = [records[j.spec] for j in jobs]
    return result


def connect_seconds() -> float:
    """How long a scheduler may take to answer: Dask's connect timeout
    (``distributed.comm.timeouts.connect``), at most `CONNECT_SECONDS`."""
    import dask.config
    from dask.utils import parse_timedelta

    try:
        dask_seconds = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"))
    except (KeyError, TypeError, ValueError):
        return CONNECT_SECONDS
    return min(CONNECT_SECONDS, float(dask_seconds))


@contextmanager
def connect(cfg: Config) -> Iterator[Client]:
    """A client of the scheduler at ``cfg.scheduler``, within `connect_seconds`.

    Nothing listening there (refused, an unknown host, no route: perhaps a scheduler not up
    yet) is a `ConnectionError` (exit 1); something that accepts the connection but does not
    answer as a Dask scheduler within the bound is the address's mistake (`PipelineError`,
    exit 2); both name the address in one line."""
    from distributed import Client
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    address = cfg.scheduler
    bound = connect_seconds()
    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location) if scheme in ("tcp", "tls") else (None, None)
    except ValueError as e:  # an address it cannot parse
        raise PipelineError(f"{cfg.source}: scheduler {address!r}: {e}") from None
    if host is not None:
        try:
            socket.create_connection((host, port), timeout=bound).close()
        except OSError as e:
            raise ConnectionError(f"cannot reach the scheduler {address}: {e}") from None
    made: Future = Future()

    def make() -> None:
        try:
            made.set_result(Client(address, timeout=f"{bound}s"))
        except BaseException as e:
            made.set_exception(e)

    threading.Thread(target=make, name="volconv-connect", daemon=True).start()
    try:
        client = made.result(timeout=bound + 2)
    except TimeoutError:
        if made.done():  # Dask's own timeout
            raise ConnectionError(f"cannot reach the scheduler {address}: timed out") from None
        raise PipelineError(
            f"{cfg.source}: scheduler {address}: accepts connections but no Dask scheduler "
            f"answered within {bound:g} s; check the address (the scheduler's "
            "port, 8786 by default, not its dashboard's)"
        ) from None
    except OSError as e:
        raise ConnectionError(f"cannot reach the scheduler {address}: {e}") from None
    except ValueError as e:
        raise PipelineError(f"{cfg.source}: scheduler {address!r}: {e}") from None
    with client:
        yield client


def slurm_cluster(
    *,
    device: str = "gpu",
    gres: str | None = "gpu:1",
    partition: str | None = None,
    account: str | None = None,
    cpus: int = 8,
    memory: str = "32GB",
    walltime: str = "02:00:00",
    interface: str | None = None,
    host: str | None = None,
    python: str | None = None,
    log_directory: str | None = None,
) -> object:
    """A dask-jobqueue ``SLURMCluster`` whose every job is one volconv worker owning one
    device: ``gres`` (one GPU, so ``CUDA_VISIBLE_DEVICES`` shows it alone; None: no gres),
    ``VOLCONV_DEVICE=device``, two threads and the resource ``GPU=2`` (one input on the
    device while the one before is written). ``cluster.scale(jobs=n)`` submits n jobs;
    `volconv run --scheduler cluster.scheduler_address` sends them the inputs.
    ``scripts/slurm_dask_example.py`` runs it; tests/test_slurm.py against a real SLURM."""
    from dask_jobqueue import SLURMCluster

    return SLURMCluster(
        queue=partition, account=account,
        cores=2,  # worker threads: two inputs, one on the device, one written
        processes=1,  # one worker per job, so one per device
        job_cpu=cpus, memory=memory, walltime=walltime, interface=interface,
        scheduler_options={"host": host} if host else {},
        python=python or sys.executable, log_directory=log_directory,
        job_extra_directives=[f"--gres={gres}"] if gres else [],
        job_script_prologue=[f"export {DEVICE_ENV}={device}"],
        worker_extra_args=["--resources", "GPU=2"],
    )  # fmt: skip


def _remote_workers(client: Client, cfg: Config, say: Callable[[str], None] | None) -> list[str]:
    """The devices of the scheduler's workers with a GPU resource, said in a line."""
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
    except TypeError:  # distributed before 2025 lists every worker without being asked
        workers = client.scheduler_info()["workers"]
    gpus = [a for a, w in workers.items() if w.get("resources", {}).get("GPU")]
    names: list[str] = []
    if gpus:
        found = client.run(describe, cfg.device, workers=gpus, on_error="return")
        names = [v if isinstance(v, str) else f"unknown ({v})" for v in found.values()]
    if say:
        label = BatchResult(names).label
        say(
            f"scheduler {cfg.scheduler}: {label}" if gpus else
            f"scheduler {cfg.scheduler}: no worker with the resource GPU yet; tasks wait for "
            f"one (start each with: {DEVICE_ENV}=0:0 dask worker {cfg.scheduler} "
            "--nworkers 1 --nthreads 2 --resources GPU=2)"
        )  # fmt: skip
    return names


def _gather(
    client: Client,
    cfg: Config,
    todo: list[Job],
    records: dict[str, VolumeReport],
    overwrite: bool,
    on_volume: Callable[[VolumeReport], None] | None,
) -> None:
    """Submit one task per job, largest first, and record each as it finishes."""
    from distributed import as_completed, wait

    batch = uuid.uuid4().hex[:12]
    futures = {
        client.submit(
            process, cfg, job.spec, None, overwrite, batch, key=f"volconv-{batch}-{i}",
            resources=RESOURCES, retries=RETRIES, priority=len(todo) - i,
        ): job
        for i, job in enumerate(todo)
    }  # fmt: skip
    try:
        # each record fetched as its task ends: a worker lost after that (a cancelled job)
        # does not make the scheduler's rerun of the task the record the batch reports
        for future, value in as_completed(futures, with_results=True, raise_errors=False):
            job = futures[future]
            records[job.spec] = record = task_record(value, job)
            if on_volume:
                on_volume(record)
    except KeyboardInterrupt as e:
        # Every running task stops at its next slab, keeping its complete slabs for a rerun
        # (with --overwrite: removing its file); the queued ones are dropped. Then the
        # cluster (or this client) closes.
        with suppress(Exception):
            client.run(stop, batch, on_error="ignore")
        with suppress(Exception):
            wait(list(futures), timeout=STOP_WAIT)
        with suppress(Exception):
            client.cancel(list(futures))
        done = sum(r.status != "failed" for r in records.values())
        error = Interrupted(
            f"interrupted: {done} output(s) complete and kept; those in progress keep their "
            "complete slabs (hidden partial files); run the same command again to resume"
        )
        error.signum = getattr(e, "signum", signal.SIGINT)  # exit 130, or 143 for SIGTERM
        raise error from e

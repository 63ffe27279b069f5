"""A batch through a real SLURM: ``munged``, ``slurmctld`` and ``slurmd`` started on
127.0.0.1 by this test (Debian's slurmctld, slurmd, slurm-client and munge, which
``scripts/setup.sh test`` installs), dask-jobqueue's ``SLURMCluster`` from
`volconv.run.cluster.slurm_cluster` submitting one job per worker, and ``volconv run --scheduler``
sending it the inputs. One job is cancelled (``scancel``) while its worker writes an input:
the batch still completes, bit for bit the one-device run's. Skipped, with the reason, where
SLURM is not installed or cannot start here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_batch import (
    SHAPES,
    assert_same_outputs,
    lines,
    make_inputs,
    one_device,
    recorded_slabs,
    statuses,
)
from test_pipeline import DEVICE, ROOT

pytest.importorskip("distributed")
pytest.importorskip("dask_jobqueue")

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "sinfo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(folder: Path, host: str) -> str:
    """One node (this host, on 127.0.0.1) of every CPU, one partition, ports of its own;
    processes tracked without cgroups; the node's GPUs as gres where it has them."""
    gpus = sorted(Path("/dev").glob("nvidia[0-9]*"))
    gres = f" Gres=gpu:{len(gpus)}" if gpus else ""
    if gpus:
        (folder / "gres.conf").write_text(
            "".join(f"Name=gpu File={g}\n" for g in gpus)
        )  # fmt: skip
    return f"""\
ClusterName=volconvtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{"GresTypes=gpu" if gpus else ""}
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory=2000{gres} State=UNKNOWN
PartitionName=volconv Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[Path]:
    """A SLURM of this host: the path of its slurm.conf (also in ``$SLURM_CONF``)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): "
                    "bash scripts/setup.sh test installs it")  # fmt: skip
    if os.geteuid() != 0:
        pytest.skip("slurmctld and slurmd run as root here; not root")
    folder = Path(tempfile.mkdtemp(prefix="volconv-slurm-"))
    folder.chmod(0o755)  # munged, as user munge, reaches its socket folder through it
    procs: list[subprocess.Popen] = []
    previous = os.environ.get("SLURM_CONF")
    try:
        munge = folder / "munge"
        for sub in ("state", "spool", "munge"):
            (folder / sub).mkdir()
        shutil.chown(munge, "munge", "munge")
        munge.chmod(0o711)
        key = munge / "munge.key"
        subprocess.run(["mungekey", "-c", "-k", key], check=True, capture_output=True)
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        subprocess.run(
            ["runuser", "-u", "munge", "--", "munged", f"--key-file={key}",
             f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
             f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"],
            check=True, capture_output=True,
        )  # fmt: skip
        conf = folder / "slurm.conf"
        conf.write_text(slurm_conf(folder, socket.gethostname()))
        os.environ["SLURM_CONF"] = str(conf)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
        procs.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", conf], **quiet))
        procs.append(subprocess.Popen(["slurmd", "-D", "-f", conf], **quiet))
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline and state not in ("idle", "mixed"):
            time.sleep(0.2)
            done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True)
            state = done.stdout.strip()
        if state not in ("idle", "mixed"):
            log = "".join(
                p.read_text()[-400:] for p in (folder / "slurmctld.log", folder / "slurmd.log")
                if p.exists()
            )  # fmt: skip
            pytest.skip(f"SLURM did not start here (node state {state!r}): {log}")
        yield conf
    finally:
        subprocess.run(["scancel", "--partition", "volconv"], capture_output=True)
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        pid = folder / "munge" / "munged.pid"
        if pid.exists():
            os.kill(int(pid.read_text()), 15)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        shutil.rmtree(folder, ignore_errors=True)


def running_jobs(wait: float = 10.0) -> list[str]:
    """The jobs SLURM still runs, once those ending have ended (within ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        states = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True,
                                check=True).stdout.split("\n")  # fmt: skip
        jobs = dict(line.split() for line in states if line.strip())
        if "COMPLETING" not in jobs.values() or time.monotonic() > deadline:
            return [j for j, state in jobs.items() if state == "RUNNING"]
        time.sleep(0.1)


def job_of(pid: int) -> str:
    """The SLURM job a process runs in (its environment's SLURM_JOB_ID)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    [job] = [v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"SLURM_JOB_ID=")]
    return job


def test_a_batch_through_slurm_survives_a_cancelled_job(slurm, tmp_path, capsys):
    import re

    from distributed import Client

    from volconv.run.cluster import slurm_cluster
    from volconv.run.pool import MEANWHILE

    pipeline = make_inputs(tmp_path)
    reference = one_device(pipeline, capsys)
    out = tmp_path / "out"
    with slurm_cluster(
        device=DEVICE, gres=None, partition="volconv", cpus=1, memory="500MB",
        walltime="00:10:00", host="127.0.0.1", log_directory=str(tmp_path / "jobs"),
    ) as cluster:  # fmt: skip
        assert "--gres" not in cluster.job_script() and f"VOLCONV_DEVICE={DEVICE}" in (
            cluster.job_script()
        )
        cluster.scale(jobs=2)
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=60)
        report = tmp_path / "report.json"
        run = subprocess.Popen(
            [sys.executable, "-m", "volconv", "run", str(pipeline), "--scheduler",
             cluster.scheduler_address, "--report", str(report)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not recorded_slabs(out) and time.monotonic() < deadline:
                assert run.poll() is None, run.communicate()
                time.sleep(0.01)
            [partial, *_] = out.glob(".*.partial-*")
            pid = int(re.search(r"-(\d+)-[^-]*$", partial.name).group(1))
            job = job_of(pid)
            subprocess.run(["scancel", job], check=True)  # mid-input
            assert job not in running_jobs(), "scancel left the job running"
            text, err = run.communicate(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    assert run.returncode == 0, (text, err)
    assert "scheduler tcp://127.0.0.1" in text and "2 worker(s)" in text
    # done, or found complete by the scheduler's rerun of a task whose worker was lost after
    # it finished (its record lost with it)
    found = {("skipped", f"became complete meanwhile ({MEANWHILE})"),
             ("skipped", "became complete meanwhile (another run)")}  # fmt: skip
    assert set(statuses(report).values()) <= {("done", ""), *found}, text
    assert lines(text, "done") >= len(SHAPES) - 1, text
    assert_same_outputs(out, reference, list(SHAPES))

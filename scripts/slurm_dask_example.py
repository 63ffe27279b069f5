"""Run a volconv pipeline on SLURM GPU nodes: dask-jobqueue submits one job per GPU, each
job one Dask worker that owns its GPU, and `volconv run --scheduler` sends it the inputs.
The cluster is `volconv.run.cluster.slurm_cluster`, the path tests/test_slurm.py runs against a
real slurmctld and slurmd (a job cancelled mid-batch, the batch still complete).

    pip install -e ".[batch]"          # distributed and dask-jobqueue
    python scripts/slurm_dask_example.py pipelines/demo.toml --gpus 8 --partition gpu
    python scripts/slurm_dask_example.py pipelines/demo.toml --gpus 8 --dry-run  # the job script

Run it where the compute nodes can reach this process (a login node), with the inputs and
outputs on a file system every node sees at the same paths. SLURM gives each job one GPU
(``--gres=gpu:1``, so ``CUDA_VISIBLE_DEVICES`` shows it alone): ``VOLCONV_DEVICE=gpu`` names
it. Each worker has two threads and the resource ``GPU=2``: two inputs at a time per GPU,
one on the device while the other's last slabs are written (volconv orders them). A job that
is cancelled or ends mid-batch loses its worker; its input runs again on another. Adapt the
partition, account, memory and time limit to your site. Arguments after the pipeline that
this script does not know go to ``volconv run`` (``--set``, ``--overwrite``, ``--report``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pipeline", help="the pipeline file")
    parser.add_argument("--gpus", type=int, default=2, help="SLURM jobs, one GPU each")
    parser.add_argument("--partition", default=None, help="SLURM partition (queue)")
    parser.add_argument("--account", default=None, help="SLURM account")
    parser.add_argument("--cpus", type=int, default=8, help="CPU cores per job (I/O threads)")
    parser.add_argument("--memory", default="32GB", help="memory per job")
    parser.add_argument("--walltime", default="02:00:00", help="time limit per job")
    parser.add_argument("--interface", default=None, help="network interface, e.g. ib0")
    parser.add_argument("--device", default="gpu", help="VOLCONV_DEVICE in each job")
    parser.add_argument("--no-gres", action="store_true", help="ask for no GPU (CPU nodes)")
    parser.add_argument("--dry-run", action="store_true", help="print the job script only")
    args, volconv_args = parser.parse_known_args()  # the rest goes to volconv run

    from distributed import Client

    from volconv.run.cluster import slurm_cluster

    cluster = slurm_cluster(
        device=args.device, gres=None if args.no_gres else "gpu:1", partition=args.partition,
        account=args.account, cpus=args.cpus, memory=args.memory, walltime=args.walltime,
        interface=args.interface,
    )  # fmt: skip
    with cluster:
        if args.dry_run:
            print(cluster.job_script())
            return 0
        cluster.scale(jobs=args.gpus)
        with Client(cluster) as client:  # volconv submits as workers join; wait for one
            t0 = time.monotonic()
            client.wait_for_workers(1)
            print(f"first worker after {time.monotonic() - t0:.0f} s in the queue", flush=True)
        run = [sys.executable, "-m", "volconv", "run", args.pipeline,
               "--scheduler", cluster.scheduler_address, *volconv_args]  # fmt: skip
        return subprocess.run(run).returncode


if __name__ == "__main__":
    sys.exit(main())

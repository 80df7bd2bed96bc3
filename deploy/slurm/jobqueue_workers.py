"""Elastic JoyNexus workers as SLURM jobs, through dask-jobqueue (``pip install dask-jobqueue==0.9.0``).

Each job runs one ``nexus worker --role ROLE`` pointed at a running service's root on shared storage (started
by ``deploy/slurm/nexus.sbatch`` or ``nexus scheduler`` anywhere): dask-jobqueue writes the batch script
(``#SBATCH`` directives from its ``SLURMJob``), submits it with ``sbatch`` and cancels it with ``scancel``; the
worker finds the scheduler in the root and joins; the control plane gives it work (a SIM worker takes
rollouts at once; a new INFER worker serves after ``nexus scale-inference N``). A job that ends is a worker
that left: its roles fail over, and a simulator is retired once it stays away.

    python deploy/slurm/jobqueue_workers.py --root ~/joynexus/root --role sim --jobs 4 --queue cpu --dry-run
    python deploy/slurm/jobqueue_workers.py --root ~/joynexus/root --role sim --jobs 4 --queue cpu
      (holds the jobs until Ctrl-C, then cancels them)

``--image joynexus-0.1.0.sif`` runs each worker in the repository's image (the Dockerfile, converted for
Apptainer as ``deploy/slurm/nexus.sbatch`` says) rather than a ``nexus`` installed on the nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex


def nexus_worker_command(root: str, role: str, scratch: str, memory_limit: str, rank: int | None = None) -> list[str]:
    """The command each job runs: named by ``$SLURM_JOB_ID`` (expanded by the job's shell), or ``actor-RANK``."""
    cmd = ["nexus", "worker", "--role", role, "--root", root, "--scratch", scratch, "--memory-limit", memory_limit]
    return cmd + (["--rank", str(rank)] if rank is not None else ["--name", f"{role}-slurm-$SLURM_JOB_ID"])


def in_image(image: str, root: str) -> list[str]:
    """The Apptainer prefix that runs a command in the image: its WORKDIR, the shared root and /tmp bound."""
    return ["apptainer", "exec", "--pwd", "/opt/joynexus", "--bind", root, "--bind", "/tmp", image]


def worker_job(command: list[str], **slurm):
    """A dask-jobqueue ``SLURMJob`` whose script runs ``command`` instead of a bare ``dask worker``."""
    from dask_jobqueue.slurm import SLURMJob

    class NexusWorkerJob(SLURMJob):
        def __init__(self) -> None:
            super().__init__(scheduler=None, name="joynexus", nanny=True, **slurm)
            # keep $SLURM_JOB_ID for the job's shell; quote everything else
            self._command_template = " ".join(a if "$" in a else shlex.quote(a) for a in command)

    return NexusWorkerJob()


async def hold(jobs: list) -> None:
    for job in jobs:
        await job.start()  # sbatch
        print(f"submitted SLURM job {job.job_id}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for job in jobs:
            await job.close()  # scancel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="the service root on shared storage")
    p.add_argument("--role", required=True, choices=["sim", "actor", "infer"])
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--rank", type=int, default=None, help="actor: the rank this one job hosts")
    p.add_argument("--scratch", default="/tmp/$USER/joynexus", help="node-local scratch directory")
    p.add_argument("--queue", default=None, help="SLURM partition")
    p.add_argument("--account", default=None)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--memory", default="8GB", help="memory of one job (the worker's limit: 90 %% of it)")
    p.add_argument("--walltime", default="04:00:00")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per job (actor / infer on GPU nodes)")
    p.add_argument("--image", default=None, help="run the worker in this Apptainer image (.sif of the Dockerfile)")
    p.add_argument("--dry-run", action="store_true", help="print the job script and submit nothing")
    a = p.parse_args()
    from dask.utils import parse_bytes

    limit = f"{int(parse_bytes(a.memory) * 0.9) // 2**20}MiB"
    command = nexus_worker_command(a.root, a.role, a.scratch, limit, a.rank)
    if a.image:
        command = in_image(a.image, a.root) + command
    extra = [f"--gres=gpu:{a.gpus}"] if a.gpus else []
    slurm = dict(queue=a.queue, account=a.account, cores=a.cores, memory=a.memory, walltime=a.walltime,
                 job_name=f"joynexus-{a.role}", job_extra_directives=extra)
    jobs = [worker_job(command, **slurm) for _ in range(1 if a.rank is not None else a.jobs)]
    if a.dry_run:
        print(jobs[0].job_script())
        return
    try:
        asyncio.run(hold(jobs))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

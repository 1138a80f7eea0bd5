"""A real SLURM on this machine for the tests of slurm/pretrain_fp8.sh: munged, slurmctld and two slurmd ("n1" and
"n2", distinct ports, both 127.0.0.1) with a CPU partition, every file in a scratch folder, on ports of their own.

Needs root (slurmd starts job processes as the submitting user) and Debian's slurm-wlm and munge packages
(.ci/run installs them). Without them, or if the daemons do not come up, the tests are skipped with the reason.
The configuration suits a single machine without cgroups: proctrack/linuxproc (proctrack/cgroup fails silently
here), task/none, no accounting."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runs import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
NODES = ("n1", "n2")
# (not PREEMPTED: under PreemptMode=REQUEUE a preempted job passes through it on its way back to the queue)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}

SLURM_CONF = """\
ClusterName=faults
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120): short, for the tests
AuthInfo=cred_expire=10
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
{nodes}
# preemption: a job in "urgent" requeues the jobs of "cpu" it needs room from; they get TERM and GraceTime to save
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=cpu Nodes={node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PriorityTier=1 GraceTime=60
PartitionName=urgent Nodes={node_list} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


@dataclass
class Job:
    id: str
    state: str
    restarts: int
    fields: dict


@dataclass
class Cluster:
    dir: Path
    conf: Path

    @property
    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode:
            raise AssertionError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        return proc.stdout

    def sbatch(self, args: list[str], env: dict, cwd: Path) -> str:
        """Submit; returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **env}, cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def jobs(self, job_id: str) -> list[Job]:
        """Every job (array task) of ``job_id``, from scontrol (there is no sacct without slurmdbd)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        jobs = []
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                jobs.append(Job(fields["JobId"], fields.get("JobState", ""), int(fields.get("Restarts", 0)), fields))
        return jobs

    def wait(self, job_id: str, timeout: float) -> list[Job]:
        """Wait until every task of ``job_id`` has ended; returns them."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            jobs = self.jobs(job_id)
            if jobs and all(j.state in FINAL_STATES for j in jobs):
                return jobs
            time.sleep(2)
        raise AssertionError(f"job {job_id} still running after {timeout:.0f} s: "
                             f"{[(j.id, j.state, j.restarts) for j in self.jobs(job_id)]}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:])
                         for p in sorted(self.dir.glob("*.log")))


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the SLURM tests start slurmd, which needs root"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key): reinstall munge"
    return None


def _munge_works() -> bool:
    proc = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, timeout=30)
    return proc.returncode == 0


def _stop(pid_file: Path) -> None:
    """Stop a daemon this fixture started, by the pid it wrote."""
    try:
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    except (OSError, ValueError):
        pass


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("slurm")
    started_munged = None
    if not _munge_works():
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        pid_file = Path("/run/munge/munged-pytest.pid")  # where the munge user can write (pytest's tmp is 0700)
        subprocess.run(["runuser", "-u", "munge", "--", "munged", f"--pid-file={pid_file}"], timeout=30)
        if not _munge_works():
            pytest.skip("munged does not start (munge -n | unmunge fails)")
        started_munged = pid_file
    (d / "state").mkdir()
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs=2 "
                      "RealMemory=4000" for n in NODES)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, dir=d, ctld_port=free_port(), slurmd_port=free_port(), nodes=nodes,
                                      node_list=",".join(NODES)))
    cluster = Cluster(d, conf)
    try:
        cluster.run("slurmctld", "-f", str(conf))
        for node in NODES:  # two slurmd on one machine: Debian's build has multiple-slurmd support (-N)
            cluster.run("slurmd", "-f", str(conf), "-N", node)
        deadline = time.time() + 30
        while "idle" not in cluster.run("sinfo", "-h", "-o", "%T", check=False) or \
                len(cluster.run("sinfo", "-h", "-N", "-t", "idle", "-o", "%N", check=False).split()) < len(NODES):
            if time.time() > deadline:
                raise AssertionError("the nodes did not become idle within 30 s")
            time.sleep(1)
    except AssertionError as err:
        for pid_file in d.glob("slurm*.pid"):
            _stop(pid_file)
        pytest.skip(f"SLURM did not start: {str(err).splitlines()[0]}\n{cluster.logs()}")
    yield cluster
    cluster.run("scancel", "--full", "--user=root", check=False)
    for pid_file in sorted(d.glob("slurm*.pid")):
        _stop(pid_file)
    if started_munged is not None:
        _stop(started_munged)

"""A real single-host Slurm for the tests: munged, slurmctld and slurmd from a generated slurm.conf.

Debian's `slurm-wlm` (22.05) and `munge`, installed with apt-get when missing
(as root; `make slurm` does the same). Every daemon runs in the foreground as a
child of the test process, with its own key, socket, state, spool, logs and
free ports under one folder, so nothing of the host's own configuration is
read or changed; `stop` cancels the jobs and stops each daemon it started.

```python
slurm = SingleHostSlurm.start(folder)
job = slurm.sbatch(["examples/multi_worker/slurm.sbatch"], env)
slurm.wait(job)            # "COMPLETED"
slurm.stop()
```
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

from tfdist.launch import free_ports

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
INSTALL = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE")


class Unavailable(Exception):
    """Why a Slurm cannot run here (the tests skip with it)."""


def _which(name: str):
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def ensure_installed(timeout: float = 900.0) -> None:
    """Installs slurm-wlm and munge with apt-get if a daemon or client is missing; `Unavailable` if it cannot."""
    if all(_which(name) for name in DAEMONS + CLIENTS):
        return
    if os.geteuid() != 0 or not _which("apt-get"):
        raise Unavailable("slurm-wlm and munge are not installed, and this user cannot install them (apt-get as "
                          "root); run `make slurm` as root, or `apt-get install slurm-wlm munge`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(INSTALL, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:  # stale package lists: refresh them once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=timeout)
        done = subprocess.run(INSTALL, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not all(_which(name) for name in DAEMONS + CLIENTS):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise Unavailable(f"`{' '.join(INSTALL)}` failed (status {done.returncode}: {last})")


class SingleHostSlurm:
    """munged, slurmctld and slurmd of one node, the host's short name, run from `folder`."""

    def __init__(self, folder: str):
        self.folder = folder
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": os.path.join(folder, "slurm.conf")}
        self.node = socket.gethostname().split(".")[0]

    @classmethod
    def start(cls, folder: str, cpus: int = 32, timeout: float = 60.0) -> SingleHostSlurm:
        """Installs if needed, writes the configuration, starts the three daemons, waits for the node."""
        ensure_installed()
        if os.geteuid() != 0:
            raise Unavailable(f"slurmd must run as root to start job steps (SlurmdUser=root); this is uid "
                              f"{os.geteuid()}")
        slurm = cls(folder)
        try:
            slurm._configure(cpus)
            slurm._start_daemons(timeout)
        except BaseException:
            slurm.stop()
            raise
        return slurm

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _configure(self, cpus: int) -> None:
        for sub in ("state", "spool"):
            os.makedirs(self._path(sub), exist_ok=True)
        with open(self._path("munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(self._path("munge.key"), 0o600)
        controller, node = free_ports(2)
        # The node claims more CPUs than the host has (config_overrides), so that the
        # example's --cpus-per-task=8 fits; tasks share the host's cores.
        lines = [
            "ClusterName=tfdisttest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={controller}",
            f"SlurmdPort={node}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self._path('munge.sock')}",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd.pid')}",
            f"SlurmctldLogFile={self._path('slurmctld.log')}",
            f"SlurmdLogFile={self._path('slurmd.log')}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmdParameters=config_overrides",
            "KillWait=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self._path("slurm.conf"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start_daemons(self, timeout: float) -> None:
        conf = self._path("slurm.conf")
        commands = {
            "munged": [_which("munged"), "--foreground", "--force", f"--key-file={self._path('munge.key')}",
                       f"--socket={self._path('munge.sock')}", f"--pid-file={self._path('munged.pid')}",
                       f"--log-file={self._path('munged.log')}", f"--seed-file={self._path('munged.seed')}"],
            "slurmctld": [_which("slurmctld"), "-D", "-f", conf],
            "slurmd": [_which("slurmd"), "-D", "-f", conf],
        }
        for name in DAEMONS:
            log = open(self._path(f"{name}.out"), "w")
            self.processes[name] = subprocess.Popen(commands[name], env=self.env, stdout=log,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            if name == "munged":
                self._wait_for(lambda: os.path.exists(self._path("munge.sock")), timeout, "munged's socket")
        self._wait_for(lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", timeout,
                       "the node to be idle")

    def _wait_for(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise Unavailable(f"{name} exited with status {process.returncode}: "
                                      f"{open(self._path(name + '.out')).read()[-1500:]}")
            if time.monotonic() > deadline:
                raise Unavailable(f"Slurm did not start within {timeout:g} s (waiting for {what})")
            time.sleep(0.2)

    def run(self, *command: str, check: bool = False) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed: {done.stderr}")
        return done

    def sbatch(self, arguments: list[str], env: dict, cwd: str) -> str:
        """Submits a batch job with the environment `env` (and this cluster's SLURM_CONF); returns its id."""
        done = subprocess.run([_which("sbatch"), "--parsable", *arguments], env={**env, "SLURM_CONF":
                              self.env["SLURM_CONF"]}, cwd=cwd, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"sbatch failed: {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        fields = dict(item.split("=", 1) for item in self.run("scontrol", "show", "job", "-o", job).stdout.split()
                      if "=" in item)
        return fields.get("JobState", "UNKNOWN")

    def wait(self, job: str, timeout: float, until=FINAL_STATES) -> str:
        """Waits until `job` reaches one of `until`; returns that state."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job)) not in until:
            if time.monotonic() > deadline:
                self.run("scancel", job)
                raise AssertionError(f"job {job} still {state} after {timeout:g} s")
            time.sleep(0.2)
        return state

    def stop(self) -> None:
        """Cancels every job, waits for their steps to end, stops the daemons this object started."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", "root")
            deadline = time.monotonic() + 40  # KillWait (30 s) for a step that ignores SIGTERM
            while self.run("squeue", "-h").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for name in reversed(DAEMONS):
            process = self.processes.pop(name, None)
            if process is None:
                continue
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

"""Local parameter-server jobs for tests: every task a separate process on 127.0.0.1.

`tfdist launch` (issue 4) starts whole jobs; the tests here also need to kill
and restart single tasks, so they drive the processes themselves.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Cluster:
    """A chief, `workers` workers and `ps` ps tasks running `script` (the same for every task)."""

    def __init__(self, script: str, args: list[str], workers: int = 1, ps: int = 1, tmp_path=None, env=None):
        ports = free_ports(1 + workers + ps)
        self.spec = {
            "chief": [f"127.0.0.1:{ports[0]}"],
            "worker": [f"127.0.0.1:{p}" for p in ports[1 : 1 + workers]],
            "ps": [f"127.0.0.1:{p}" for p in ports[1 + workers :]],
        }
        self.script, self.args, self.tmp_path = script, list(args), tmp_path
        self.env = dict(env or {})
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.all_procs: list[subprocess.Popen] = []

    def _env(self, task: str, index: int) -> dict:
        env = dict(os.environ)
        env.pop("TFDIST_LOCAL_DEVICES", None)
        env.update(self.env)
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env["TF_CONFIG"] = json.dumps({"cluster": self.spec, "task": {"type": task, "index": index}})
        return env

    def log_path(self, task: str, index: int) -> str:
        return os.path.join(str(self.tmp_path), f"{task}_{index}.log")

    def start(self, task: str, index: int = 0, extra_args: list[str] | None = None) -> subprocess.Popen:
        log = open(self.log_path(task, index), "ab")
        proc = subprocess.Popen(
            [sys.executable, self.script, *self.args, *(extra_args or [])],
            env=self._env(task, index),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.procs[(task, index)] = proc
        self.all_procs.append(proc)
        return proc

    def start_all(self, chief_args: list[str] | None = None) -> subprocess.Popen:
        for i in range(len(self.spec["ps"])):
            self.start("ps", i)
        for i in range(len(self.spec["worker"])):
            self.start("worker", i)
        return self.start("chief", 0, chief_args)

    def kill(self, task: str, index: int) -> None:
        proc = self.procs[(task, index)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def wait_chief(self, timeout: float = 150) -> int:
        return self.procs[("chief", 0)].wait(timeout=timeout)

    def log(self, task: str = "chief", index: int = 0) -> str:
        with open(self.log_path(task, index), errors="replace") as f:
            return f.read()

    def wait_all_exit(self, timeout: float = 30) -> dict:
        """Waits for every task to exit by itself; returns {(task, index): exit code}."""
        deadline = time.monotonic() + timeout
        for proc in self.all_procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {key: proc.poll() for key, proc in self.procs.items()}

    def stop(self) -> None:
        for proc in self.all_procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.all_procs:
            proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

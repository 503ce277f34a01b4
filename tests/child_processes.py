"""A fixture for tests that start processes: none of them may outlive the test."""

from __future__ import annotations

import os
import time

import pytest


def descendants(pid: int) -> list[int]:
    """Pids of every living descendant of `pid` (Linux /proc; zombies excluded)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state, ppid, ...
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.fixture
def no_leftover_processes():
    """Fails the test if any process it started is still running when it ends."""
    before = set(descendants(os.getpid()))
    yield
    deadline = time.monotonic() + 5.0
    left = set(descendants(os.getpid())) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = set(descendants(os.getpid())) - before
    assert not left, f"processes left running after the test: {sorted(left)}"

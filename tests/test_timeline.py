"""`tfdist launch --timeline` and the step report across workers (issue 39): one real 2-worker job.

tests/report_job.py runs under `python -m tfdist.cli launch --workers 2
--timeline FILE`: worker 1 sleeps 60 ms in Python before each step (a
straggler), both report their steps (`StepReport`), and in a second `fit`
worker 1 stops until worker 0's collective times out (collective_timeout 10 s).
One job serves every test here (module fixture). The steps of a multi-process
job are split by timed ablations, not TensorFlow's profiler (which corrupts
the tasks' heap: `tfdist.report.recorder.PROFILER_IN_JOBS`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from tfdist.report import timeline

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_job.py")
DELAY_S = 0.06  # report_job.DELAY_S
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("report_job")
    trace = out / "timeline.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "PYTHONFAULTHANDLER": "1"}  # a crash names its Python frame in the output
    done = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "launch", "--workers", "2", "--timeout", "240", "--timeline", str(trace),
         "--", sys.executable, JOB, str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    # The job's status may be worker 0's SIGSEGV inside TensorFlow where its collective timed out
    # (`get_graph_debug_info`: about 1 job in 10 here, tfdist's report on or off); what ran before is whole.
    assert done.returncode in (0, 139), done.stdout[-3000:] + done.stderr[-3000:]
    reports = {}
    for task, name in (("worker:0", "report.json"), ("worker:1", "report.worker-1.json")):
        with open(out / name) as f:
            reports[task] = json.load(f)
    with open(trace) as f:
        merged = json.load(f)
    return {"out": out, "reports": reports, "trace": merged, "stderr": done.stderr, "stdout": done.stdout,
            "status": done.returncode}


def test_the_straggler_is_exchange_on_the_worker_that_waits_and_other_on_itself(job):
    fast, slow = job["reports"]["worker:0"], job["reports"]["worker:1"]
    for report in (fast, slow):
        assert report["replicas"] == 2 and report["local_replicas"] == 1
        assert report["flops_per_step"] > 0 and report["samples_per_step"] == 64
        assert sum(report["phases_s"].values()) == pytest.approx(report["step_s"]["median"], rel=0.1)
        assert report["phases_method"].startswith("timed ablations (a task of a multi-process job")
        assert report["ablation_s"]["exchange_alone"] > 0
    # Worker 0 waits in the all-reduce for worker 1's 60 ms in Python before each call.
    assert fast["phases_s"]["exchange"] - slow["phases_s"]["exchange"] == pytest.approx(DELAY_S, abs=0.015)
    assert slow["phases_s"]["other"] - fast["phases_s"]["other"] == pytest.approx(DELAY_S, abs=0.015)
    assert fast["exchange_wait_s"] == pytest.approx(DELAY_S, abs=0.015)
    assert fast["step_s"]["median"] == pytest.approx(slow["step_s"]["median"], rel=0.1)  # one job, one pace


def test_the_merged_trace_is_a_chrome_trace_with_one_track_per_worker(job):
    trace = job["trace"]
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert {"ph", "pid", "tid", "name"} <= set(e), e
        assert e["ph"] in ("X", "M")
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "worker:0", 1: "worker:1"}
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {(p, t) for p in (0, 1) for t in ("steps", "phases", "collectives")}
    steps = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert sorted(e["name"] for e in steps if e["pid"] == 0) == sorted(f"host call {i}" for i in range(2, 12))
    assert "tfdist launch: timeline of 2 task(s) written to" in job["stderr"]


def _collectives(trace):
    out: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e.get("cat") == "collective" and e["name"] != "wait for peers":
            out[(e["pid"], e["args"]["call"], e["args"]["collective"])] = e
    return out


def test_collectives_show_the_late_worker(job):
    trace = job["trace"]
    ops = _collectives(trace)
    instances = {(call, k) for _, call, k in ops}
    assert sorted(instances) == [(call, 0) for call in range(2, 12)]  # one exchange per step of the window
    gaps = []
    for call, k in instances:
        a, b = ops[(0, call, k)], ops[(1, call, k)]
        assert a["name"] == b["name"] == "exchange (estimated)"
        assert a["args"]["arrival"] == b["args"]["arrival"] == (
            "estimated: the host call's start plus the forward-backward pass timed alone")
        gaps.append(abs((a["ts"] + a["dur"]) - (b["ts"] + b["dur"])))
        assert a["args"]["last_to_arrive"] == "worker:1"
    # Aligned clocks: the same exchange ends at the same time on both (microseconds; each end is the
    # call's end less the update timed alone, so a step's ends differ by that estimate's noise; on a
    # loaded 2-core host one step in ten can be descheduled for tens of milliseconds: one outlier allowed).
    assert sorted(gaps)[len(gaps) // 2] < 5000.0 and sorted(gaps)[-2] < 15000.0
    waits = [e for e in trace["traceEvents"] if e["name"] == "wait for peers"]
    assert {e["pid"] for e in waits} == {0}  # only the worker that arrived first waits
    assert sorted(e["dur"] for e in waits)[len(waits) // 2] == pytest.approx(DELAY_S * 1e6, abs=20000)
    # The host calls of both workers, aligned: they end together (one all-reduce ends each).
    calls = {(e["pid"], e["name"]): e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1}
    ends, late = [], []
    for i in range(2, 12):
        a, b = calls[(0, f"host call {i}")], calls[(1, f"host call {i}")]
        ends.append(abs((a["ts"] + a["dur"]) - (b["ts"] + b["dur"])))
        late.append(b["ts"] - a["ts"])
    # (Within the exchange's bound above: the suite's other process shares the two cores.)
    assert sorted(ends)[5] < 5000.0 and sorted(ends)[-2] < 15000.0
    assert sorted(late)[5] == pytest.approx(DELAY_S * 1e6, abs=15000)  # worker 1 starts its calls late


def test_merge_estimates_a_clock_offset_from_the_host_calls(job, tmp_path):
    # The tasks' own files, as if worker 1's clock ran 3 s ahead.
    for i, shift in ((0, 0), (1, 3 * 10**9)):
        with open(job["out"] / f"worker-{i}.json") as f:
            task = json.load(f)
        shifted = copy.deepcopy(task)
        shifted["calls"] = [[c, s + shift, e + shift, n] for c, s, e, n in task["calls"]]
        shifted["runs"] = [[c, s + shift, e + shift, p] for c, s, e, p in task["runs"]]
        shifted["collectives"] = [[o, s + shift, e + shift, c] for o, s, e, c in task["collectives"]]
        with open(tmp_path / f"worker-{i}.json", "w") as f:
            json.dump(shifted, f)
    merged = timeline.merge(str(tmp_path), str(tmp_path / "merged.json"))
    assert merged["otherData"]["clock_offsets_ms"]["worker:1"] == pytest.approx(
        3000 + job["trace"]["otherData"]["clock_offsets_ms"]["worker:1"], abs=1e-6)
    # One host, one clock: the estimate, from the host calls' ends, is off by no more than the ends differ:
    # up to a ring step of the exchange (the last to arrive finishes its last step after the first).
    exchange_alone = job["reports"]["worker:0"]["ablation_s"]["exchange_alone"]
    assert abs(job["trace"]["otherData"]["clock_offsets_ms"]["worker:1"]) < 1.0 + 1e3 * exchange_alone
    original, recovered = _collectives(job["trace"]), _collectives(merged)
    assert recovered.keys() == original.keys()
    for key, e in recovered.items():
        assert e["ts"] == pytest.approx(original[key]["ts"], abs=1.0)


def test_a_timed_out_collective_names_the_worker_that_had_not_arrived(job):
    crashed = "Fatal Python error: Segmentation fault" in job["stdout"] and "get_graph_debug_info" in job["stdout"]
    if job["status"] == 139 and crashed and not (job["out"] / "timeout.txt").exists():
        pytest.skip("worker 0 crashed inside TensorFlow 2.21 as its collective timed out (SIGSEGV in "
                    "context.get_graph_debug_info, before any Python saw the error): an upstream crash")
    assert job["status"] == 0, job["stdout"][-3000:]
    with open(job["out"] / "timeout.txt") as f:
        error = f.read()
    assert "waited longer than collective_timeout=10 s" in error
    # The first fit ran 22 host calls (0-21); in the second, worker 0 began call 24 and worker 1 stopped after 23.
    assert ("Tasks that had not arrived at host call 24 when this collective timed out: worker:1 (last began host "
            "call 23, ") in error


def test_merge_aligns_profiled_tasks_by_their_collectives_ends_and_shows_each_wait(tmp_path):
    # Two profiled tasks (as with TFDIST_PROFILE_ALL_TASKS=1): worker 1's clock 5 ms ahead; in true time
    # worker 0 reaches each all-reduce at 10 ms into the call, worker 1 at 30 ms; both end at 40 ms.
    ms = 10**6
    for index, skew, arrive in ((0, 0, 10), (1, 5, 30)):
        calls = [[c, c * 100 * ms + skew * ms, (c * 100 + 45) * ms + skew * ms, 1] for c in range(3)]
        collectives = [["CollectiveReduceV2", (c * 100 + arrive + skew) * ms, (c * 100 + 40 + skew) * ms, c]
                       for c in range(3)]
        task = {"task": f"worker:{index}", "worker_index": index, "split": "profiler", "profiled": True,
                "calls": calls, "runs": [], "collectives": collectives}
        with open(tmp_path / f"worker-{index}.json", "w") as f:
            json.dump(task, f)
    trace = timeline.merge(str(tmp_path), str(tmp_path / "t.json"))
    assert trace["otherData"]["clock_offsets_ms"] == {"worker:0": 0.0, "worker:1": 5.0}
    waits = [e for e in trace["traceEvents"] if e["name"] == "wait for peers"]
    assert [(e["pid"], e["dur"]) for e in waits] == [(0, 20000.0)] * 3  # microseconds
    ops = [e for e in trace["traceEvents"] if e["name"] == "CollectiveReduceV2"]
    assert {(e["pid"], e["ts"] % 100000, e["dur"], e["args"]["last_to_arrive"], e["args"]["arrival"]) for e in ops} \
        == {(p, 30000.0, 10000.0, "worker:1", "recorded") for p in (0, 1)}


def test_merge_without_task_files_says_why(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        timeline.merge(str(tmp_path), str(tmp_path / "t.json"))
    assert str(e.value).startswith(f"No task wrote a timeline to {tmp_path}: the job ran no profiled step")

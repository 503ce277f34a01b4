"""Cluster validation (issue 4): every malformed job description fails at one place, by name."""

from __future__ import annotations

import json

import pytest

import tfdist
from tfdist.cluster import ClusterConfig, ClusterConfigError, from_slurm, parse_tf_config

TWO_WORKERS = {"worker": ["localhost:12345", "localhost:23456"]}


def tf_config(cluster=None, task_type="worker", index=0):
    return json.dumps({"cluster": cluster or TWO_WORKERS, "task": {"type": task_type, "index": index}})


def test_cluster_config_error_is_exported_and_a_value_error():
    assert tfdist.ClusterConfigError is ClusterConfigError
    assert issubclass(ClusterConfigError, ValueError)


def test_valid_tf_config_is_parsed():
    config = parse_tf_config(tf_config(index=1))
    assert config == ClusterConfig(
        cluster={"worker": ("localhost:12345", "localhost:23456")}, task_type="worker", task_id=1
    )
    assert config.num_workers == 2
    assert config.is_chief is False
    assert config.address == "localhost:23456"
    assert parse_tf_config(config.to_tf_config()) == config


def test_chief_is_chief_task_else_worker_zero():
    with_chief = {"chief": ["localhost:1000"], "worker": ["localhost:1001"]}
    assert parse_tf_config(tf_config(with_chief, "chief", 0)).is_chief
    assert not parse_tf_config(tf_config(with_chief, "worker", 0)).is_chief
    assert parse_tf_config(tf_config(with_chief, "worker", 0)).num_workers == 2
    assert parse_tf_config(tf_config(index=0)).is_chief


def test_evaluator_outside_the_cluster_is_accepted():
    config = parse_tf_config(tf_config(task_type="evaluator", index=0))
    assert (config.task_type, config.task_id, config.address) == ("evaluator", 0, None)


def test_reads_environment_variable(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(index=1))
    assert parse_tf_config().task_id == 1


def test_unset_tf_config_says_how_to_set_it(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config()
    assert str(e.value) == (
        "TF_CONFIG: the environment variable TF_CONFIG is not set. Start the process with "
        "`tfdist launch`, set TF_CONFIG to the job's JSON description, or pass "
        "cluster_resolver= to the strategy."
    )


def test_malformed_json_names_the_value():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config('{"cluster": {"worker": ["localhost:1"]},')
    assert str(e.value) == (
        "TF_CONFIG: is not valid JSON (Expecting property name enclosed in double quotes at line 1 "
        "column 41). Received: TF_CONFIG='{\"cluster\": {\"worker\": [\"localhost:1\"]},'"
    )


def test_missing_cluster():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config({"task": {"type": "worker", "index": 0}})
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster' is missing. Expected e.g. "
        '{"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, "task": {"type": "worker", '
        '"index": 0}}. Received fields: [\'task\']'
    )


def test_missing_task():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config({"cluster": TWO_WORKERS})
    assert str(e.value) == (
        "TF_CONFIG: field 'task' is missing. Expected e.g. \"task\": {\"type\": \"worker\", "
        "\"index\": 0} naming this process. Received fields: ['cluster']"
    )


def test_task_index_out_of_range():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config(index=2))
    assert str(e.value) == (
        "TF_CONFIG: field 'task.index' is out of range: job 'worker' has 2 task(s), so the index "
        "must be 0..1. Received: task.index=2"
    )


def test_negative_task_index():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config(index=-1))
    assert str(e.value) == "TF_CONFIG: field 'task.index' must be an integer >= 0. Received: task.index=-1"


def test_unknown_job_type_in_cluster():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"wroker": ["localhost:1"]}))
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster' has unknown job type 'wroker'. "
        "Valid job types: chief, worker, ps, evaluator."
    )


def test_unknown_job_type_in_task():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config(task_type="master"))
    assert str(e.value) == (
        "TF_CONFIG: field 'task.type' is an unknown job type 'master'. "
        "Valid job types: chief, worker, ps, evaluator."
    )


def test_task_type_missing_from_cluster():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config(task_type="ps"))
    assert str(e.value) == (
        "TF_CONFIG: field 'task.type' is 'ps', but the cluster has no 'ps' job. Jobs in the cluster: worker."
    )


def test_port_that_is_not_a_number():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"worker": ["localhost:12345", "localhost:23x56"]}))
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster.worker[1]' has a port that is not a number: '23x56'. Expected "
        "'host:port' with a port in 1..65535, e.g. 'localhost:2222'. "
        "Received: cluster.worker[1]='localhost:23x56'"
    )


def test_address_without_port():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"worker": ["localhost"]}))
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster.worker[0]' must be a 'host:port' string such as 'localhost:2222'. "
        "Received: cluster.worker[0]='localhost' (no port)"
    )


def test_port_out_of_range():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"worker": ["localhost:70000"]}))
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster.worker[0]' has port 70000, outside 1..65535. "
        "Received: cluster.worker[0]='localhost:70000'"
    )


def test_duplicate_addresses_across_jobs():
    # 127.0.0.1 and localhost are the same host.
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"chief": ["127.0.0.1:2222"], "worker": ["localhost:2222"]}, "chief"))
    assert str(e.value) == (
        "TF_CONFIG: fields 'cluster.chief[0]' and 'cluster.worker[0]' have the same address "
        "'localhost:2222'; every task needs its own host:port."
    )


def test_two_chiefs():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}))
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster.chief' must have exactly one task. Received: 2 tasks ['a:1', 'b:1']"
    )


def test_cluster_without_trainers():
    with pytest.raises(ClusterConfigError) as e:
        parse_tf_config(tf_config({"ps": ["a:1"]}, "ps"))
    assert str(e.value) == (
        "TF_CONFIG: field 'cluster' has no 'chief' or 'worker' job; someone must train. Received jobs: ps"
    )


def test_explicit_config_is_validated_with_its_source():
    with pytest.raises(ClusterConfigError) as e:
        ClusterConfig.create({"worker": ["a:1"]}, "worker", 3, source="my cluster")
    assert str(e.value).startswith("my cluster: field 'task.index' is out of range")


SLURM_ENV = {
    "SLURM_PROCID": "2",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
}


def test_slurm_step_becomes_a_validated_cluster(monkeypatch):
    # Two tasks on node07 (ports 8888, 8889), one on node08; rank 2 is worker 2.
    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    config = from_slurm()
    assert config == ClusterConfig(
        cluster={"worker": ("node07:8888", "node07:8889", "node08:8888")}, task_type="worker", task_id=2
    )


def test_slurm_outside_a_job_step_says_how(monkeypatch):
    for k in SLURM_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ClusterConfigError) as e:
        from_slurm()
    assert str(e.value) == (
        "Slurm job step: cannot read the job from the Slurm environment (SLURM_PROCID not found in "
        "environment. Not running inside a SLURM step?). Run the script with `srun` inside an "
        "allocation (sbatch/salloc), which sets SLURM_PROCID, SLURM_STEP_NUM_TASKS, "
        "SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE."
    )


def test_cluster_source_names_how_the_cluster_was_given(monkeypatch):
    import tensorflow as tf

    from tfdist.cluster import ClusterSource

    monkeypatch.delenv("TFDIST_RESTART_COUNT", raising=False)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(TWO_WORKERS))
    given = ClusterSource.of(resolver)
    env = ClusterSource.of(None)
    monkeypatch.setenv("TFDIST_RESTART_COUNT", "0")  # every task `tfdist launch` starts has it
    launched = ClusterSource.of(None)
    assert [s.label for s in (given, env, launched)] == [
        "cluster_resolver=SimpleClusterResolver",
        "TF_CONFIG",
        "the TF_CONFIG set by `tfdist launch`",
    ]
    assert [s.add_job("worker") for s in (given, env, launched)] == [
        "add a 'worker' job to the tf.train.ClusterSpec of the resolver passed as cluster_resolver=, "
        'e.g. {..., "worker": ["localhost:2224"]}',
        'add a \'worker\' job to the cluster in every process\'s TF_CONFIG, e.g. "worker": ["host:2222"]',
        "add --workers 2 to the `tfdist launch` command (e.g. tfdist launch --chief --workers 2 --ps 1 "
        "-- python train.py)",
    ]


def test_validate_jobs_checks_a_cluster_without_a_task():
    from tfdist.cluster import validate_jobs

    cluster = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}
    assert validate_jobs(cluster, "cluster_resolver=SimpleClusterResolver") == {
        "worker": ("localhost:1", "localhost:2"),
        "ps": ("localhost:3",),
    }
    with pytest.raises(ClusterConfigError) as e:
        validate_jobs({"worker": ["localhost:1"], "ps": ["127.0.0.1:1"]}, "cluster_resolver=SimpleClusterResolver")
    assert str(e.value) == (
        "cluster_resolver=SimpleClusterResolver: fields 'cluster.worker[0]' and 'cluster.ps[0]' have the "
        "same address '127.0.0.1:1'; every task needs its own host:port."
    )


def test_slurm_tasks_take_their_ports_from_tfdist_slurm_port_base(monkeypatch):
    monkeypatch.delenv("SLURM_STEP_NODELIST", raising=False)
    for name, value in {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node1",
                        "SLURM_STEP_TASKS_PER_NODE": "2", "TFDIST_SLURM_PORT_BASE": "41000"}.items():
        monkeypatch.setenv(name, value)
    config = from_slurm()
    assert config.cluster == {"worker": ("node1:41000", "node1:41001")} and config.task_id == 1
    monkeypatch.setenv("TFDIST_SLURM_PORT_BASE", "99999")
    with pytest.raises(ClusterConfigError) as error:
        from_slurm()
    assert str(error.value) == ("Slurm job step: environment variable TFDIST_SLURM_PORT_BASE must be a port in "
                                "1..65535. Received: TFDIST_SLURM_PORT_BASE='99999'")

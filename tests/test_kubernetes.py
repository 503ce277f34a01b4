"""Kubernetes without TFJob: the Indexed Job example and `cluster="kubernetes"` (issue 38, item 7).

No cluster runs here. The manifests in examples/kubernetes/job.yaml are read
into the Kubernetes API's own models (the official `kubernetes` Python client,
a test dependency): every field must be one the API knows, of its type, and the
required ones present (a misspelt field is dropped by the model, so each object
must survive the round trip unchanged). Then every pod's environment is built
as Kubernetes builds it for an Indexed Job (the container's env, plus
`JOB_COMPLETION_INDEX` and the hostname `<job>-<index>`), and
`tfdist.cluster.from_kubernetes` must give each pod its task and every pod's
address: the headless Service's DNS names on the port the Service and the
container declare.
"""

from __future__ import annotations

import copy
import os

import pytest

import tfdist
from tfdist import cluster

yaml = pytest.importorskip("yaml", reason="PyYAML (installed with the test extra: pip install -e .[test])")

MANIFEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "kubernetes",
                        "job.yaml")
MODELS = {("v1", "Service"): "V1Service", ("batch/v1", "Job"): "V1Job",
          ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy"}


@pytest.fixture(scope="module")
def objects():
    with open(MANIFEST) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {d["kind"]: d for d in docs}


def pod_environment(job: dict, index: int) -> dict:
    """What the container of pod `index` of an Indexed Job sees: its env, the index, its hostname."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return {**env, "JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{job['metadata']['name']}-{index}"}


def test_the_manifests_are_objects_of_the_kubernetes_api(objects):
    client = pytest.importorskip("kubernetes.client", reason="the kubernetes client (the test extra: "
                                                             "pip install -e .[test])")
    api = client.ApiClient()
    assert sorted(objects) == ["Job", "NetworkPolicy", "Service"]
    for doc in objects.values():
        name = MODELS[(doc["apiVersion"], doc["kind"])]
        model = getattr(client, name)
        # Version 34 and later: pydantic models that check types and required fields.
        obj = model.from_dict(copy.deepcopy(doc)) if hasattr(model, "from_dict") else \
            api._ApiClient__deserialize(copy.deepcopy(doc), name)
        assert api.sanitize_for_serialization(obj) == doc, f"{name}: a field the API does not know, or mistyped"


def test_the_job_is_indexed_its_pods_named_by_the_headless_service_and_preemption_recreates_them(objects):
    job, service = objects["Job"], objects["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["TFDIST_NUM_WORKERS"]) == 2
    # The pods' subdomain is the headless Service, which selects them and publishes them before they are ready.
    assert pod["subdomain"] == service["metadata"]["name"] == env["TFDIST_SERVICE"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    port = int(env.get("TFDIST_PORT", cluster.KUBERNETES_PORT))
    assert service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"] == port
    assert objects["NetworkPolicy"]["spec"]["ingress"][0]["ports"][0]["port"] == port
    assert container["command"][container["command"].index("--cluster") + 1] == "kubernetes"
    # A worker saved on SIGTERM exits with TFDIST_PREEMPTION_EXIT_CODE; such pods, and evicted ones,
    # are recreated without counting against backoffLimit, within the grace period Kubernetes gives.
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    assert {"action": "Ignore", "onExitCodes": {"containerName": container["name"], "operator": "In",
                                                "values": [int(env["TFDIST_PREEMPTION_EXIT_CODE"])]}} in rules
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] > float(env["TFDIST_GRACE_PERIOD"])


def test_each_pod_of_the_indexed_job_derives_its_task_and_every_address(objects):
    job = objects["Job"]
    names = [f"tfdist-multi-worker-{j}.tfdist-workers:2222" for j in range(2)]
    for index in range(2):
        config = cluster.from_kubernetes(pod_environment(job, index))
        assert config.to_tf_config() == {"cluster": {"worker": names}, "task": {"type": "worker", "index": index},
                                         "rpc_layer": "grpc"}
        assert config.is_chief == (index == 0)
    other = {**pod_environment(job, 1), "TFDIST_NAMESPACE": "ml", "TFDIST_PORT": "3000",
             "TFDIST_JOB_NAME": "renamed", "HOSTNAME": "anything"}
    assert cluster.from_kubernetes(other).cluster["worker"] == ("renamed-0.tfdist-workers.ml:3000",
                                                                "renamed-1.tfdist-workers.ml:3000")


@pytest.mark.parametrize("change, message", [
    ({"JOB_COMPLETION_INDEX": None},
     "Kubernetes Indexed Job: the environment variable JOB_COMPLETION_INDEX is not set; Kubernetes sets it in the "
     "pods of a Job with `completionMode: Indexed`: run the script in such a Job (see examples/kubernetes/job.yaml)."),
    ({"JOB_COMPLETION_INDEX": "2"},
     "Kubernetes Indexed Job: JOB_COMPLETION_INDEX=2 is out of range for TFDIST_NUM_WORKERS=2: set "
     "TFDIST_NUM_WORKERS to the Job's `completions` (= `parallelism`)."),
    ({"TFDIST_SERVICE": None},
     "Kubernetes Indexed Job: the environment variable TFDIST_SERVICE is not set; set it in the pod template's env "
     "to the name of the headless Service that is the pods' `subdomain` (see examples/kubernetes/job.yaml)."),
    ({"HOSTNAME": "worker-7"},
     "Kubernetes Indexed Job: cannot tell the Job's name: HOSTNAME='worker-7' is not '<job name>-1', as Kubernetes "
     "names an Indexed Job's pod. Set TFDIST_JOB_NAME in the pod template's env."),
    ({"TFDIST_NUM_WORKERS": "two"},
     "Kubernetes Indexed Job: the environment variable TFDIST_NUM_WORKERS must be an integer >= 1. Received: "
     "TFDIST_NUM_WORKERS='two'"),
])
def test_a_pod_environment_that_is_not_an_indexed_jobs_is_named(objects, change, message):
    env = pod_environment(objects["Job"], 1)
    for name, value in change.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    with pytest.raises(tfdist.ClusterConfigError) as error:
        cluster.from_kubernetes(env)
    assert str(error.value) == message


def test_the_multi_worker_strategy_reads_the_cluster_from_kubernetes(monkeypatch):
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    with pytest.raises(tfdist.ClusterConfigError, match="^Kubernetes Indexed Job: the environment variable "
                                                        "JOB_COMPLETION_INDEX is not set"):
        tfdist.get_strategy("multi_worker", cluster="kubernetes")

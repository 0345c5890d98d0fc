"""Issue 76 items 1, 3 and 5: the shipped KubeRay manifests (deploy/kuberay/) pass `behemoth check-cluster`, which
checks them against KubeRay v1.7.0's CRD schema and behemoth's rules offline; each mutation a user could make is
refused in one line naming the field. (The SIGTERM drain on a Ray node started as a pod starts it: R8 in
tests/integration/test_fault_tolerance.py. No Kubernetes cluster is reachable here.)"""

import copy
from pathlib import Path

import pytest
import yaml
from behemoth.driver.commands.cli import main
from behemoth.driver.commands.cluster_check import check_cluster

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "kuberay").glob("*.yaml"))


def test_every_shipped_manifest_passes(capsys):
    assert {p.name for p in MANIFESTS} == {"resnet50-8gpu-rayjob.yaml", "resnet50-8gpu-raycluster.yaml",
                                           "chat-lora-rayjob.yaml", "chat-lora-raycluster.yaml"}
    for path in MANIFESTS:
        assert check_cluster(path) == [], path
    assert main(["check-cluster", str(MANIFESTS[0])]) == 0 and capsys.readouterr().out.strip().endswith(": OK")


def _spot_job() -> dict:
    return yaml.safe_load((REPO / "deploy" / "kuberay" / "chat-lora-rayjob.yaml").read_text())


def _findings(tmp_path, manifest: dict, jobs=()) -> list[str]:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return [str(f) for f in check_cluster(path, list(jobs))]


CLUSTER = ("spec", "rayClusterSpec")


def _at(d: dict, *keys):
    for k in keys:
        d = d[k]
    return d


def _spot(m):
    return _at(m, *CLUSTER, "workerGroupSpecs", 1, "template", "spec")


def _head(m):
    return _at(m, *CLUSTER, "headGroupSpec")


def _gpu_container(m):
    return _at(m, *CLUSTER, "workerGroupSpecs", 0, "template", "spec", "containers", 0)


MUTATIONS = {
    "a spot group's grace period under its drain": (
        lambda m: _spot(m).update(terminationGracePeriodSeconds=60),
        "spec.rayClusterSpec.workerGroupSpecs[1].template.spec.terminationGracePeriodSeconds: 60 s"),
    "a grace period equal to the drain (SIGKILL as the node's processes stop)": (
        lambda m: _spot(m).update(terminationGracePeriodSeconds=120),
        "spec.rayClusterSpec.workerGroupSpecs[1].template.spec.terminationGracePeriodSeconds: 120 s"),
    "the drain switched off": (
        lambda m: _spot(m)["containers"][0]["env"][0].update(value="0"),
        "workerGroupSpecs[1].template.spec.containers[0].env.RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: 0"),
    "the head on spot": (
        lambda m: _head(m)["template"]["spec"].update(nodeSelector={"cloud.google.com/gke-spot": "true"}),
        "spec.rayClusterSpec.headGroupSpec.template.spec: the head pod may land on spot capacity"),
    "a GPU request without a limit": (
        lambda m: _gpu_container(m)["resources"]["limits"].pop("nvidia.com/gpu"),
        "workerGroupSpecs[0].template.spec.containers[0].resources.limits.nvidia.com/gpu: 8 GPUs requested, limit none"),
    "no /dev/shm": (
        lambda m: _gpu_container(m).update(volumeMounts=[v for v in _gpu_container(m)["volumeMounts"]
                                                          if v["mountPath"] != "/dev/shm"]),
        "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.volumes: no memory volume at /dev/shm"),
    "the dashboard as a LoadBalancer": (
        lambda m: _head(m).update(serviceType="LoadBalancer"),
        "spec.rayClusterSpec.headGroupSpec.serviceType: the dashboard and job API are exposed outside the cluster"),
    "token auth off": (
        lambda m: _at(m, *CLUSTER).update(authOptions={"mode": "disabled"}),
        "spec.rayClusterSpec.authOptions.mode: Ray's token auth is off"),
    "a value of the wrong type (KubeRay's schema)": (
        lambda m: _at(m, *CLUSTER, "workerGroupSpecs", 0).update(replicas="two"),
        "spec.rayClusterSpec.workerGroupSpecs[0].replicas: 'two' is not of type 'integer'"),
    "a misspelt field (KubeRay's schema)": (
        lambda m: _spot(m).update(terminationGracePeriodSecond=200),
        "spec.rayClusterSpec.workerGroupSpecs[1].template.spec.terminationGracePeriodSecond: a field KubeRay's schema "
        "does not have"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_mutation_is_refused_naming_its_field(tmp_path, mutation):
    change, said = MUTATIONS[mutation]
    manifest = _spot_job()
    change(manifest)
    found = _findings(tmp_path, manifest)
    assert len(found) == 1 and said in found[0], found


def test_local_storage_is_refused_where_the_cluster_has_more_than_one_pod(tmp_path):
    job = tmp_path / "job.yaml"
    config = yaml.safe_load((REPO / "jobs" / "configs" / "chat_lora_8gpu.yaml").read_text())
    config["checkpoint"]["storage_path"] = "/home/ray/runs"
    job.write_text(yaml.safe_dump(config))
    manifest = _spot_job()
    manifest["spec"]["entrypoint"] = "python -m behemoth train job.yaml"  # (no --set of the storage path)
    found = _findings(tmp_path, manifest, [str(job)])
    assert len(found) == 1 and "checkpoint.storage_path: '/home/ray/runs' is a local path and the cluster has up to " \
                                "3 pods" in found[0], found
    # the entrypoint's own --set of the storage path is what the run uses
    assert _findings(tmp_path, _spot_job(), [str(job)]) == []
    one_pod = copy.deepcopy(manifest)
    one_pod["spec"]["rayClusterSpec"]["workerGroupSpecs"] = []
    assert _findings(tmp_path, one_pod, [str(job)]) == []


def test_a_drain_shorter_than_the_runs_measured_checkpoint_writes_is_refused(tmp_path):
    """--job with a run that has records: its slowest measured checkpoint write x 2.5 + 5 s (a notice's two
    checkpoints) must fit in every worker group's drain (the manifests' 120 s)."""
    import json

    job = tmp_path / "job.yaml"
    config = yaml.safe_load((REPO / "jobs" / "configs" / "chat_lora_8gpu.yaml").read_text())
    config["checkpoint"].update(storage_path=str(tmp_path / "runs"), run_name="chat-lora")
    job.write_text(yaml.safe_dump(config))
    run = tmp_path / "runs" / "chat-lora"
    run.mkdir(parents=True)
    manifest = _spot_job()
    manifest["spec"]["entrypoint"] = "python -m behemoth train job.yaml"
    for slowest, refused in ((20.0, False), (50.0, True)):
        rows = [{"step": 100, "checkpoint_write_s": 12.0}, {"step": 200, "checkpoint_write_s": slowest}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        found = [f for f in _findings(tmp_path, manifest, [str(job)]) if "a drain of" in f]
        assert len(found) == (2 if refused else 0), found  # (both worker groups)
    assert found[0].startswith("spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].env."
                               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: a drain of 120 s is shorter than 130 s")


def test_an_unusual_manifest_is_read_without_a_crash(tmp_path):
    """No spec at all (the CRD does not require one); a drain given by valueFrom (known only in the cluster: not
    judged); a sidecar container after the Ray one (it runs no `ray start`)."""
    assert _findings(tmp_path, {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"}}) == [
        "spec.authOptions.mode: Ray's token auth is off: anyone who reaches a Ray port runs code on the cluster. "
        "Fix: set authOptions: {mode: token}"]
    manifest = _spot_job()
    env = _spot(manifest)["containers"][0]["env"][0]
    env.pop("value")
    env["valueFrom"] = {"configMapKeyRef": {"name": "ray", "key": "drain"}}
    _spot(manifest)["containers"].append({"name": "logs", "image": "busybox"})
    assert _findings(tmp_path, manifest) == []

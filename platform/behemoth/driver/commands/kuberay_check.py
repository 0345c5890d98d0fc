"""`behemoth check-cluster` on a KubeRay manifest (a RayCluster or a RayJob, `apiVersion: ray.io/v1`), offline,
before `kubectl apply`:

1. KubeRay's own schema: the CRDs' openAPIV3Schema of the KubeRay version named below (vendored from the
   ray-project/kuberay repository, tag v1.7.0, ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs}.yaml:
   `kuberay_crds_v1.7.0.json.gz` beside this module), checked with jsonschema; a field the schema does not know
   is refused too (the API server drops it silently, `kubectl apply --validate=strict` refuses it).
2. behemoth's rules, each refusal one line naming the field path: Ray's token auth on; the head not on spot
   capacity (losing it ends the job); the dashboard's Service not exposed outside the cluster; GPU requests with
   equal limits; `/dev/shm` a memory volume on every worker group (Kubernetes gives 64 MB: DataLoader and NCCL
   fail); every worker group's `terminationGracePeriodSeconds` above its Ray drain timeout
   (`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`, 30 s by default, > 0): a pod's eviction is SIGTERM, which Ray 2.60
   turns into a drain (reason preemption) for that long, so behemoth checkpoints as for a cloud notice
   (tests/integration/test_fault_tolerance.py R8), and SIGKILL must not come first; with `--job`, the run's
   storage not a local path when the cluster has more than one pod, the job config checked as `behemoth
   check` does, and where the run has records in a folder read here as a path, every drain long enough for a
   notice's two checkpoints at its slowest measured write (`checkpoint_write_s`).
"""

from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

KUBERAY_VERSION = "v1.7.0"
SCHEMAS = Path(__file__).with_name(f"kuberay_crds_{KUBERAY_VERSION}.json.gz")
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
DRAIN_DEFAULT_S = 30.0  # Ray 2.60's
GRACE_DEFAULT_S = 30.0  # Kubernetes'
GRACE_MARGIN_S = 5.0  # between the drain's end and SIGKILL: the node's processes are stopped after the drain
# A notice's checkpoints (worker/reporting.py): one at once, the last FINAL_WRITE_FACTOR (1.5) writes, two
# reports and a second before the deadline: 2.5 writes and some seconds of steps at least
DRAIN_WRITES, DRAIN_SLACK_S = 2.5, 5.0
SPOT = {"cloud.google.com/gke-spot": "true", "eks.amazonaws.com/capacityType": "SPOT",
        "karpenter.sh/capacity-type": "spot", "kubernetes.azure.com/scalesetpriority": "spot"}
EXPOSED = ("LoadBalancer", "NodePort")
GPU = "nvidia.com/gpu"


def is_kuberay(raw) -> bool:
    return isinstance(raw, dict) and str(raw.get("apiVersion", "")).startswith("ray.io/")


def check_kuberay(raw: dict, job_configs: list[str], finding) -> list:
    """The manifest's findings (`finding(key, problem, fix)` makes one)."""
    kind = raw.get("kind")
    if kind not in ("RayCluster", "RayJob") or raw.get("apiVersion") != "ray.io/v1":
        return [finding("kind", f"{raw.get('apiVersion')} {kind} is not a KubeRay ray.io/v1 RayCluster or RayJob",
                        "check a RayCluster or RayJob manifest (deploy/kuberay/)")]
    found = [finding(key, problem, f"see KubeRay {KUBERAY_VERSION}'s {kind} reference") for key, problem in
             _schema_problems(raw, _schemas()[kind])]
    if found:
        return found
    spec = raw.get("spec") or {}
    cluster, at = (spec, "spec") if kind == "RayCluster" else (spec.get("rayClusterSpec"), "spec.rayClusterSpec")
    if cluster is None:  # (a RayJob on an existing cluster, spec.clusterSelector: that cluster's manifest is checked)
        return found
    head = cluster.get("headGroupSpec", {})
    workers = cluster.get("workerGroupSpecs") or []
    if (cluster.get("authOptions") or {}).get("mode") != "token":
        found.append(finding(f"{at}.authOptions.mode", "Ray's token auth is off: anyone who reaches a Ray port runs "
                             "code on the cluster", "set authOptions: {mode: token}"))
    if head.get("serviceType") in EXPOSED or head.get("enableIngress"):
        key = f"{at}.headGroupSpec.{'serviceType' if head.get('serviceType') in EXPOSED else 'enableIngress'}"
        found.append(finding(key, "the dashboard and job API are exposed outside the cluster",
                             "keep serviceType ClusterIP and reach them with kubectl port-forward"))
    head_pod = (head.get("template") or {}).get("spec") or {}
    if _on_spot(head_pod):
        found.append(finding(f"{at}.headGroupSpec.template.spec", "the head pod may land on spot capacity: losing it "
                             "ends the job (GCS fault tolerance protects Serve, not a training run)",
                             "select on-demand nodes for the head (no spot nodeSelector or toleration)"))
    groups = [(f"{at}.headGroupSpec", head)] + [(f"{at}.workerGroupSpecs[{i}]", g) for i, g in enumerate(workers)]
    for where, group in groups:
        pod = (group.get("template") or {}).get("spec") or {}
        found += _gpu_limits(f"{where}.template.spec", pod, finding)
    drains = []
    for where, group in groups[1:]:
        pod = (group.get("template") or {}).get("spec") or {}
        found += _worker_pod(f"{where}.template.spec", pod, finding, drains)
    pods = 1 + sum(int(g.get("maxReplicas", g.get("replicas", 1)) or 0) * int(g.get("numOfHosts", 1) or 1)
                   for g in workers)
    found += _jobs(raw, job_configs, pods, drains, finding)
    return found


@lru_cache(maxsize=1)
def _schemas() -> dict:
    return json.loads(gzip.decompress(SCHEMAS.read_bytes()))


def _schema_problems(raw: dict, schema: dict) -> list[tuple[str, str]]:
    import jsonschema

    problems = [(_path(e.absolute_path), e.message) for e in
                sorted(jsonschema.Draft7Validator(schema).iter_errors(raw), key=lambda e: list(e.absolute_path))]
    return problems + [(key, "a field KubeRay's schema does not have (the API server drops it; kubectl apply "
                             "--validate=strict refuses it)") for key in _unknown(raw, schema, "")]


def _unknown(value, schema: dict, at: str) -> list[str]:
    """The paths of mapping keys `schema` does not declare, where it declares its properties and keeps no others."""
    if isinstance(value, dict) and "properties" in schema:
        keeps = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("additionalProperties")
        out = []
        for key, item in value.items():
            if key in schema["properties"]:
                out += _unknown(item, schema["properties"][key], f"{at}.{key}" if at else key)
            elif not keeps and at:  # (the top level's apiVersion/kind/metadata are the API server's)
                out.append(f"{at}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [k for i, item in enumerate(value) for k in _unknown(item, schema["items"], f"{at}[{i}]")]
    return []


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(the manifest)"


def _on_spot(pod: dict) -> bool:
    selector = pod.get("nodeSelector") or {}
    tolerated = {(t.get("key"), str(t.get("value", "")).lower()) for t in pod.get("tolerations") or []}
    return any(str(selector.get(k, "")).lower() == v.lower() for k, v in SPOT.items()) or any(
        k in SPOT and (not v or v == SPOT[k].lower()) for k, v in tolerated)


def _containers(pod: dict) -> list[tuple[int, dict]]:
    return list(enumerate(pod.get("containers") or []))


def _gpu_limits(at: str, pod: dict, finding) -> list:
    out = []
    for i, c in _containers(pod):
        resources = c.get("resources") or {}
        asked, limit = (resources.get("requests") or {}).get(GPU), (resources.get("limits") or {}).get(GPU)
        if asked is not None and str(asked) != str(limit):
            out.append(finding(f"{at}.containers[{i}].resources.limits.{GPU}", f"{asked} GPUs requested, limit "
                               f"{'none' if limit is None else limit}",
                               "set the limit equal to the request (Kubernetes schedules GPUs by limit)"))
    return out


def _worker_pod(at: str, pod: dict, finding, drains: list) -> list:
    """The pod's findings; each container's drain (path, seconds) appended to `drains`."""
    out = []
    shm = {m.get("name") for _, c in _containers(pod) for m in c.get("volumeMounts") or []
           if m.get("mountPath") == "/dev/shm"}
    memory = {v.get("name") for v in pod.get("volumes") or [] if (v.get("emptyDir") or {}).get("medium") == "Memory"}
    if not shm & memory:
        out.append(finding(f"{at}.volumes", "no memory volume at /dev/shm: a pod's is 64 MB, and Ray Data's workers, "
                           "DataLoader and NCCL fail in it", "mount an emptyDir {medium: Memory, sizeLimit: ...} at "
                           "/dev/shm in every container"))
    grace = float(pod.get("terminationGracePeriodSeconds", GRACE_DEFAULT_S))
    for i, c in _containers(pod)[:1]:  # (KubeRay's Ray container is the first; a sidecar runs no `ray start`)
        env = {e.get("name"): e for e in c.get("env") or []}
        if DRAIN_ENV in env and "value" not in env[DRAIN_ENV]:  # (valueFrom: known only in the cluster)
            continue
        drain = _seconds((env.get(DRAIN_ENV) or {}).get("value"), DRAIN_DEFAULT_S)
        if drain is not None and drain > 0:
            drains.append((f"{at}.containers[{i}].env.{DRAIN_ENV}", drain))
        if drain is None or drain <= 0:
            out.append(finding(f"{at}.containers[{i}].env.{DRAIN_ENV}", "0 or not a number of seconds: a SIGTERM "
                               "(an eviction) ends the node at once and the run loses the steps since its last "
                               "checkpoint", "give Ray's drain the seconds a checkpoint needs (e.g. 120)"))
        elif grace < drain + GRACE_MARGIN_S:
            out.append(finding(f"{at}.terminationGracePeriodSeconds", f"{grace:g} s (Kubernetes' SIGKILL) is not above "
                               f"containers[{i}]'s Ray drain of {drain:g} s ({DRAIN_ENV}) by {GRACE_MARGIN_S:g} s: an "
                               f"eviction can kill the node before behemoth's last checkpoint", f"set it to at least "
                               f"{drain + GRACE_MARGIN_S:g}, or shorten the drain"))
    return out


def _seconds(value, default: float) -> float | None:
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _jobs(raw: dict, job_configs: list[str], pods: int, drains: list, finding) -> list:
    """--job: each config as `behemoth check` loads it (the RayJob entrypoint's --set of the storage path
    applied), its checkpoint storage not local where the cluster has more than one pod, and where the run has
    records already, every drain long enough for its measured checkpoint writes."""
    from behemoth.job import load_config
    from behemoth.storage.store import Store
    from behemoth.storage import paths
    from behemoth.tracking.records import read_jsonl

    out = []
    entry = (raw.get("spec") or {}).get("entrypoint") or ""
    overrides = re.findall(r"--set\s+'?(checkpoint\.storage_path=[^\s']+)", entry)
    for path in job_configs:
        cfg = load_config(path, overrides)  # (ConfigError: the job's own problem, said as `behemoth check` says it)
        storage = cfg.checkpoint.storage_path
        if pods > 1 and Store(storage).is_local:
            out.append(finding(f"{path}: checkpoint.storage_path", f"{storage!r} is a local path and the cluster has "
                               f"up to {pods} pods: each would keep its own checkpoints, and a restarted pod finds "
                               f"none", "use object storage (s3://, gs://) or a shared filesystem mounted in every "
                               "pod at the same path"))
        records = paths.join(storage, cfg.checkpoint.run_name, "metrics.jsonl")
        # (offline: a run folder this machine reads as a path, local or mounted; a bucket is not asked)
        written = [r["checkpoint_write_s"] for r in (read_jsonl(records) if Store(storage).is_local else [])
                   if "checkpoint_write_s" in r]
        if written:
            needs = DRAIN_WRITES * max(written) + DRAIN_SLACK_S
            out += [finding(key, f"a drain of {drain:g} s is shorter than {needs:.0f} s, what a notice's two "
                            f"checkpoints need at run {cfg.checkpoint.run_name!r}'s slowest measured write "
                            f"({max(written):.1f} s)", "raise it (and terminationGracePeriodSeconds above it)")
                    for key, drain in drains if drain < needs]
    return out

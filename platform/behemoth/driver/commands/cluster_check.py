"""`behemoth check-cluster cluster.yaml`: validate a Ray cluster launcher config offline, then lint it (a KubeRay
RayCluster or RayJob manifest: kuberay_check.py).

1. Ray's own checks, no cloud calls: `prepare_config` (merges the provider's defaults) and `validate_config`
   (the autoscaler's JSON schema, head_node_type, worker counts).
2. behemoth's security and correctness lints, on the config as `ray up` would run it (defaults merged):
   placeholders left unfilled (REPLACE_ME); any Ray port (fixed, the worker range, or where the OS places the
   ones `ray start` leaves to it) or SSH open to the world (0.0.0.0/0, ::/0); token auth missing or its token
   not mounted; the dashboard bound to 0.0.0.0; SSH left to the launcher's world-open default, GPU nodes without declared GPUs, and (with
   --job) a local checkpoint storage path on a multi-node cluster.
Each finding names the key (and line) and the fix.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from behemoth.errors import ConfigError
from behemoth.storage.store import Store

# Every port a Ray node listens on (Ray 2.60's `ray start` defaults), and SSH. A port `ray start` is given
# explicitly (`--object-manager-port=8076`, ...) is checked at that number instead.
RAY_PORTS = {22: "SSH", 6379: "GCS", 8265: "dashboard / job API", 10001: "Ray client",
             52365: "dashboard agent"}
PORT_FLAGS = {"--port": "GCS", "--dashboard-port": "dashboard / job API", "--ray-client-server-port": "Ray client",
              "--dashboard-agent-listen-port": "dashboard agent", "--dashboard-agent-grpc-port": "dashboard agent gRPC",
              "--object-manager-port": "object manager", "--node-manager-port": "node manager",
              "--runtime-env-agent-port": "runtime env agent", "--metrics-export-port": "metrics export"}
WORKER_PORTS = (10002, 19999)  # --min-worker-port / --max-worker-port
# Ports `ray start` leaves to the OS when not given (node and object manager, agents' gRPC, runtime env agent,
# metrics export): Linux's ephemeral range.
EPHEMERAL = (32768, 60999)
PLACEHOLDER = "REPLACE_ME"  # the template's marker for a value only the user knows (cluster.yaml)
WORLD = {"0.0.0.0/0", "::/0"}
GPU_INSTANCE = re.compile(r"^(p\d|g\d|gr\d|dl\d|trn\d|inf\d)", re.IGNORECASE)
DEFAULT_TOKEN_PATH = "~/.ray/auth_token"


@dataclass
class Finding:
    key: str
    problem: str
    fix: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.key} (line {self.line})" if self.line else self.key
        return f"{where}: {self.problem}. Fix: {self.fix}"


def check_cluster(path: str | Path, job_configs: list[str] | None = None) -> list[Finding]:
    logging.getLogger("ray.autoscaler").setLevel(logging.WARNING)  # prepare_config's INFO chatter
    if not Path(path).is_file():
        raise ConfigError(f"cluster file {path} does not exist")
    text = Path(path).read_text()
    try:
        every = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        return [Finding("<file>", f"not valid YAML ({' '.join(str(e).split())})", "fix the syntax")]
    from behemoth.driver.commands.kuberay_check import check_kuberay, is_kuberay

    documents = [d for d in every if d is not None]  # (an empty one: a stray `---`)
    manifests = [(n, d) for n, d in enumerate(every, 1) if is_kuberay(d)]
    if manifests:  # KubeRay RayClusters or RayJobs (kuberay_check.py), beside what `kubectl apply` also takes
        return [finding for n, m in manifests for finding in
                _in_document(check_kuberay(m, job_configs or [], Finding), n, len(every))]
    if len(documents) > 1:  # a `ray up` file is one document
        return [Finding("<file>", f"holds {len(documents)} YAML documents and none is a KubeRay RayCluster or "
                        f"RayJob", "give one cluster config per file (`ray up`'s, or KubeRay manifests)")]
    raw = documents[0] if documents else None
    lines = _line_index(text)
    prepared, findings = _ray_schema(raw)
    if findings:  # the lints assume a structurally valid config
        return _with_lines(findings, lines)
    findings += _placeholders(raw)
    findings += _open_ports(raw) + _ssh_default(raw) + _token_auth(prepared) + _dashboard_host(prepared)
    findings += _gpu_resources(raw) + _spot_watch(raw) + _storage(raw, job_configs or [])
    return _with_lines(findings, lines)


def _in_document(findings: list[Finding], n: int, of: int) -> list[Finding]:
    """A manifest's findings, named by their document where the file holds more than one."""
    for f in findings if of > 1 else []:
        f.key = f"document {n} of {of}: {f.key}"
    return findings


def _empty_keys(node, key: str = "") -> list[Finding]:
    """Keys given no value (`file_mounts:` with every entry commented out, an empty `docker:`): Ray's
    prepare_config reads them as mappings and fails with an AttributeError naming none."""
    if isinstance(node, dict):
        return [f for k, v in node.items() for f in _empty_keys(v, f"{key}.{k}" if key else str(k))]
    if isinstance(node, list):
        return [f for i, v in enumerate(node) for f in _empty_keys(v, f"{key}[{i}]")]
    if node is None and key:
        return [Finding(key, "is empty (nothing after its colon, or every entry commented out)",
                        "give it its value or entries, or remove the key")]
    return []


def _ray_schema(raw) -> tuple[dict, list[Finding]]:
    """The config with the provider's defaults merged (as `ray up` runs it), and Ray's objections to it."""
    import json

    import jsonschema
    import ray.autoscaler
    from behemoth.ray_internals.core import prepare_cluster_config, validate_cluster_config

    if not isinstance(raw, dict):
        return {}, [Finding("<file>", "must be a mapping", "start from cluster.yaml in the repository")]
    if empty := _empty_keys(raw):
        return {}, empty
    try:
        prepared = prepare_cluster_config(copy.deepcopy(raw))
        # Every schema violation at once (validate_config stops at the first), then Ray's other checks.
        schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(prepared), key=lambda e: list(e.path))
        if errors:
            return prepared, [Finding(".".join(str(p) for p in e.absolute_path) or "<top level>",
                                      f"Ray's cluster schema rejects it: {e.message}",
                                      "see Ray's cluster YAML reference") for e in errors]
        validate_cluster_config(prepared)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # (a shape no check above foresaw)
        key = "head_node_type" if "head_node_type" in str(e) else "<config>"
        return {}, [Finding(key, f"Ray rejects it: {e}", "correct the value")]
    return prepared, []


def _open_ports(raw: dict) -> list[Finding]:
    """Each Ray port (and SSH) that a security-group rule opens to 0.0.0.0/0 or ::/0."""
    fixed, randomised, (wlo, whi) = _ray_ports(raw)
    out = []
    rules = raw.get("provider", {}).get("security_group", {}).get("IpPermissions", [])
    for i, rule in enumerate(rules):
        key = f"provider.security_group.IpPermissions[{i}]"
        if malformed := _malformed_rule(rule, key):  # (not in Ray's schema: boto3 refuses it at `ray up`)
            out += malformed
            continue
        cidrs = {r.get("CidrIp") for r in rule.get("IpRanges", [])} | {
            r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])}
        if not cidrs & WORLD:
            continue
        all_ports = str(rule.get("IpProtocol", "tcp")) == "-1" or rule.get("FromPort", 0) == -1
        lo, hi = (0, 65535) if all_ports else (rule.get("FromPort", 0), rule.get("ToPort", rule.get("FromPort", 0)))
        world = ", ".join(sorted(cidrs & WORLD))
        opened = [f"port {port} ({name})" for port, name in sorted(fixed.items()) if lo <= port <= hi]
        if lo <= whi and wlo <= hi:
            opened.append(f"ports {max(lo, wlo)}-{min(hi, whi)} (Ray's worker ports {wlo}-{whi})")
        if randomised and lo <= EPHEMERAL[1] and EPHEMERAL[0] <= hi:
            opened.append(f"ports {max(lo, EPHEMERAL[0])}-{min(hi, EPHEMERAL[1])} (where the OS places Ray's "
                          f"{', '.join(randomised)})")
        for what in opened:
            fix = ("allow SSH from your own CIDR only" if what.startswith("port 22 ") else
                   "remove the rule (nodes reach each other inside the group); reach the dashboard with "
                   "`ray dashboard cluster.yaml` (SSH tunnel)")
            out.append(Finding(key, f"{what} is open to the world ({world})", fix))
    return out


def _malformed_rule(rule, key: str) -> list[Finding]:
    """A security-group rule not in EC2's shape: ports as integers, address ranges as mappings."""
    if not isinstance(rule, dict):
        return [Finding(key, f"{rule!r} is not a rule", "write it as {IpProtocol: tcp, FromPort: 22, ToPort: 22, "
                        "IpRanges: [{CidrIp: 10.0.0.0/8}]}")]
    out = [Finding(f"{key}.{port}", f"{rule[port]!r} is not a port number", f"write it as an integer: {port}: 22")
           for port in ("FromPort", "ToPort") if port in rule
           and (not isinstance(rule[port], int) or isinstance(rule[port], bool))]
    for ranges, field in (("IpRanges", "CidrIp"), ("Ipv6Ranges", "CidrIpv6")):
        given = rule.get(ranges, [])
        if not isinstance(given, list) or not all(isinstance(r, dict) for r in given):
            out.append(Finding(f"{key}.{ranges}", f"{given!r} is not a list of mappings",
                               f"write each range as a mapping: {ranges}: [{{{field}: 10.0.0.0/8}}]"))
    return out


def _ray_ports(raw: dict) -> tuple[dict[int, str], list[str], tuple[int, int]]:
    """(fixed port -> what listens there, services on OS-chosen ports, the worker port range) for the
    cluster's `ray start` commands."""
    commands = " ".join(str(c) for key in ("head_start_ray_commands", "worker_start_ray_commands")
                        for c in raw.get(key) or [])
    given = {flag: int(m.group(1)) for flag in [*PORT_FLAGS, "--min-worker-port", "--max-worker-port"]
             if (m := re.search(r"(?<![\w-])" + re.escape(flag) + r"[= ](\d+)", commands))}
    fixed = {port: name for port, name in RAY_PORTS.items()
             if not any(PORT_FLAGS.get(flag) == name for flag in given)}
    randomised = []
    for flag, name in PORT_FLAGS.items():
        if given.get(flag):  # 0 means "the OS chooses"
            fixed[given[flag]] = name
        elif name not in RAY_PORTS.values():
            randomised.append(name)
    return fixed, randomised, (given.get("--min-worker-port", WORKER_PORTS[0]),
                               given.get("--max-worker-port", WORKER_PORTS[1]))


def _placeholders(raw, key: str = "") -> list[Finding]:
    """Values the template leaves for the user (REPLACE_ME): `ray up` would fail on them, or worse."""
    if isinstance(raw, dict):
        return [f for k, v in raw.items() for f in _placeholders(v, f"{key}.{k}" if key else str(k))]
    if isinstance(raw, list):
        return [f for i, v in enumerate(raw) for f in _placeholders(v, f"{key}[{i}]")]
    if isinstance(raw, str) and PLACEHOLDER in raw:
        return [Finding(key, f"'{raw}' is a placeholder", "fill in before `ray up` (see the file's header)")]
    return []


def _ssh_default(raw: dict) -> list[Finding]:
    """Ray's AWS launcher adds SSH from 0.0.0.0/0 to any security group it creates itself."""
    if raw.get("provider", {}).get("type") != "aws":
        return []
    missing = [name for name, t in raw["available_node_types"].items()
               if not t.get("node_config", {}).get("SecurityGroupIds")]
    return [Finding(f"available_node_types.{name}.node_config",
                    "no SecurityGroupIds: Ray's launcher creates a group with SSH open to 0.0.0.0/0",
                    "create a group with SSH from your CIDR only (see cluster.yaml's header) and list it")
            for name in missing]


def _token_auth(prepared: dict) -> list[Finding]:
    out, token_paths = [], set()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = " ; ".join(prepared.get(key) or [])
        if "RAY_AUTH_MODE=token" not in commands:
            out.append(Finding(key, "starts Ray without token authentication",
                               "prefix `ray start` with `export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.ray/auth_token;`"))
        m = re.search(r"RAY_AUTH_TOKEN_PATH=(\S+?);?(\s|$)", commands)
        token_paths.add(m.group(1) if m else DEFAULT_TOKEN_PATH)
    mounts = {_home(dest) for dest in (prepared.get("file_mounts") or {})}
    for token in sorted(token_paths):
        if _home(token) not in mounts:
            out.append(Finding("file_mounts", f"the auth token {token} is not mounted onto the nodes",
                               f'add "{token}": "~/.ray/auth_token" (your local token, mode 0600, never committed)'))
    return out


def _dashboard_host(prepared: dict) -> list[Finding]:
    commands = " ; ".join(prepared.get("head_start_ray_commands") or [])
    if "--dashboard-host=0.0.0.0" in commands or "--dashboard-host 0.0.0.0" in commands:
        return [Finding("head_start_ray_commands", "the dashboard binds to 0.0.0.0 (Ray's launcher default)",
                        "use --dashboard-host=127.0.0.1 and `ray dashboard cluster.yaml` to reach it")]
    return []


def _gpu_resources(raw: dict) -> list[Finding]:
    out = []
    for name, node_type in raw["available_node_types"].items():
        instance = str(node_type.get("node_config", {}).get("InstanceType", ""))
        if GPU_INSTANCE.match(instance) and not node_type.get("resources", {}).get("GPU"):
            out.append(Finding(f"available_node_types.{name}.resources",
                               f"{instance} is a GPU instance but declares no GPU resources",
                               'declare them, e.g. resources: {"CPU": 96, "GPU": 8}'))
    return out


def _spot_watch(raw: dict) -> list[Finding]:
    """Spot node types (an EC2 InstanceMarketOptions of MarketType spot, a GCE scheduling.preemptible or
    provisioningModel SPOT) need `behemoth spot-watch` started on their nodes: without it every preemption is a
    node lost without notice."""
    def spot(config: dict) -> bool:
        market = str((config.get("InstanceMarketOptions") or {}).get("MarketType", "")).lower()
        scheduling = config.get("scheduling") or {}
        return market == "spot" or bool(scheduling.get("preemptible")) or \
            str(scheduling.get("provisioningModel", "")).upper() == "SPOT"

    commands = " ".join(str(c) for c in raw.get("worker_start_ray_commands") or [])
    if "spot-watch" in commands:
        return []
    return [Finding(f"available_node_types.{name}.node_config",
                    "a spot node type, and worker_start_ray_commands do not start `behemoth spot-watch`: each "
                    "preemption would lose up to checkpoint.every_n_steps of work (no drain at the cloud's notice)",
                    "add `nohup behemoth spot-watch --cloud aws > /tmp/behemoth-spot-watch.log 2>&1 &` (gce on GCP) "
                    "to worker_start_ray_commands, after `ray start`, as cluster.yaml does")
            for name, t in raw["available_node_types"].items() if spot(t.get("node_config") or {})]


def _storage(raw: dict, job_configs: list[str]) -> list[Finding]:
    from behemoth.job import load_config

    multi_node = raw.get("max_workers", 0) > 0 and any(
        t.get("max_workers", 0) > 0 for t in raw["available_node_types"].values())
    out = []
    for job in job_configs:
        path = load_config(job).checkpoint.storage_path
        if multi_node and Store(path).is_local:
            out.append(Finding(f"{job}: checkpoint.storage_path",
                               f"'{path}' is a local path on a multi-node cluster: workers on other nodes "
                               f"cannot reach it and a lost node loses its checkpoints",
                               "use object storage, e.g. s3://my-bucket/behemoth-runs"))
    return out


def _home(path: str) -> str:
    return re.sub(r"^(/home/[^/]+|/root|\$HOME)(?=/)", "~", path.rstrip("/"))


def _line_index(text: str) -> dict[str, int]:
    """Dotted key -> line number, for the keys of nested mappings (sequences by index)."""
    index: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                index[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                index[f"{prefix}[{i}]"] = v.start_mark.line + 1
                walk(v, f"{prefix}[{i}]")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return index


def _with_lines(findings: list[Finding], lines: dict[str, int]) -> list[Finding]:
    for f in findings:
        key = f.key
        while key and f.line is None:
            f.line = lines.get(key)
            key = key.rsplit(".", 1)[0] if "." in key else ""
    return findings


def add_command(sub) -> None:
    p = sub.add_parser("check-cluster", help="validate a Ray cluster YAML (`ray up`'s, or a KubeRay RayCluster or "
                       "RayJob manifest) offline against its schema and lint it")
    p.add_argument("cluster_yaml", help="the cluster config for `ray up` (cluster.yaml) or a KubeRay manifest "
                   "(deploy/kuberay/*.yaml)")
    p.add_argument("--job", dest="jobs", action="append", default=[], metavar="JOB_YAML",
                   help="also check a job config meant for this cluster (e.g. its checkpoint storage path)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    import sys

    findings = check_cluster(args.cluster_yaml, args.jobs)
    for finding in findings:
        print(f"{args.cluster_yaml}: {finding}", file=sys.stderr)
    print(f"{args.cluster_yaml}: {len(findings)} problem(s)" if findings else f"{args.cluster_yaml}: OK")
    return 1 if findings else 0

"""check-cluster: Ray's schema offline, then security lints; each mutation of cluster.yaml is named."""

import re
from pathlib import Path

import pytest
import yaml

from behemoth.driver.commands.cli import main
from behemoth.driver.commands.cluster_check import check_cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster.yaml"


def filled(text: str) -> str:
    """The template with its placeholders filled in, as a user would."""
    return text.replace("ami-REPLACE_ME", "ami-0a0b0c0d0e0f01234").replace("sg-REPLACE_ME", "sg-0123456789abcdef0")


def mutated(tmp_path, edit) -> Path:
    cfg = yaml.safe_load(filled(CLUSTER.read_text()))
    edit(cfg)
    out = tmp_path / "cluster.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def messages(path, jobs=None) -> str:
    return "\n".join(str(f) for f in check_cluster(path, jobs))


def test_the_template_shows_only_its_placeholders_and_a_filled_copy_passes(tmp_path, capsys):
    findings = check_cluster(CLUSTER)
    assert {f.problem for f in findings} == {"'ami-REPLACE_ME' is a placeholder", "'sg-REPLACE_ME' is a placeholder"}
    assert len(findings) == 8 and all("fill in before `ray up`" in f.fix for f in findings)  # 4 node types
    copy = tmp_path / "cluster.yaml"
    copy.write_text(filled(CLUSTER.read_text()))
    assert check_cluster(copy) == []
    assert main(["check-cluster", str(copy), "--job", str(REPO / "jobs/configs/resnet50_imagenet_8gpu.yaml")]) == 0
    assert "OK" in capsys.readouterr().out


def _open_port(cfg, port_from, port_to, cidr="0.0.0.0/0"):
    cfg["provider"]["security_group"] = {"GroupName": "x", "IpPermissions": [
        {"FromPort": 22, "ToPort": 22, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "10.0.0.0/8"}]},
        {"FromPort": port_from, "ToPort": port_to, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": cidr}]}]}


def _start_flags(cfg, flags: str):
    cfg["head_start_ray_commands"] = [c.replace("--disable-usage-stats", flags + " --disable-usage-stats")
                                      for c in cfg["head_start_ray_commands"]]


def _drop_token(cfg):
    cfg["worker_start_ray_commands"] = [c.replace("export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=~/.ray/auth_token; ", "")
                                        for c in cfg["worker_start_ray_commands"]]


CASES = [
    ("misspelled key", lambda c: c.update(max_worker=c.pop("max_workers")), r"'max_worker' was unexpected"),
    ("wrong head_node_type", lambda c: c.update(head_node_type="head_gpu"),
     r"head_node_type.*must be one of `available_node_types`"),
    ("string for a number", lambda c: c["available_node_types"]["gpu_a100x8"].update(max_workers="four"),
     r"available_node_types.gpu_a100x8.max_workers.*'four' is not of type 'integer'"),
    ("dashboard open to the world", lambda c: _open_port(c, 8265, 8265),
     r"IpPermissions\[1\].*port 8265 \(dashboard / job API\) is open to the world"),
    ("range covering the GCS port", lambda c: _open_port(c, 6000, 7000, "::/0") or
     c["provider"]["security_group"]["IpPermissions"][1].update(IpRanges=[], Ipv6Ranges=[{"CidrIpv6": "::/0"}]),
     r"port 6379 \(GCS\) is open to the world"),
    ("SSH from anywhere", lambda c: _open_port(c, 22, 22), r"port 22 \(SSH\) is open to the world.*your own CIDR"),
    ("dashboard agent over IPv6", lambda c: _open_port(c, 52365, 52365, "::/0") or
     c["provider"]["security_group"]["IpPermissions"][1].update(IpRanges=[], Ipv6Ranges=[{"CidrIpv6": "::/0"}]),
     r"port 52365 \(dashboard agent\) is open to the world \(::/0\)"),
    ("the object manager port the template sets", lambda c: _open_port(c, 8000, 8100),
     r"port 8076 \(object manager\) is open"),
    ("part of the worker port range", lambda c: _open_port(c, 15000, 25000),
     r"ports 15000-19999 \(Ray's worker ports 10002-19999\) is open"),
    ("a moved worker port range", lambda c: _start_flags(c, "--min-worker-port=20000 --max-worker-port=20100") or
     _open_port(c, 20050, 20050), r"ports 20050-20050 \(Ray's worker ports 20000-20100\)"),
    ("where the OS puts the node manager", lambda c: _open_port(c, 40000, 40010),
     r"ports 40000-40010 \(where the OS places Ray's dashboard agent gRPC, node manager, runtime env agent, "
     r"metrics export\)"),
    ("a metrics export port set explicitly", lambda c: _start_flags(c, "--metrics-export-port=9100") or
     _open_port(c, 9100, 9100), r"port 9100 \(metrics export\) is open"),
    ("the GCS moved and opened", lambda c: c.update(head_start_ray_commands=[
        cmd.replace("--port=6379", "--port=7000") for cmd in c["head_start_ray_commands"]]) or _open_port(c, 7000, 7000),
     r"port 7000 \(GCS\) is open"),
    ("a placeholder left", lambda c: c["available_node_types"]["gpu_a100x8"]["node_config"].update(
        ImageId="ami-REPLACE_ME"), r"gpu_a100x8.node_config.ImageId.*'ami-REPLACE_ME' is a placeholder"),
    ("no token auth on workers", _drop_token, r"worker_start_ray_commands.*starts Ray without token authentication"),
    ("token not mounted", lambda c: c["file_mounts"].pop("~/.ray/auth_token"),
     r"file_mounts.*auth token ~/.ray/auth_token is not mounted"),
    ("dashboard bound to 0.0.0.0", lambda c: c.pop("head_start_ray_commands"),
     r"dashboard binds to 0.0.0.0"),
    ("GPU node without GPUs", lambda c: c["available_node_types"]["gpu_a100x8"].update(resources={"CPU": 96}),
     r"gpu_a100x8.resources.*p4de.24xlarge is a GPU instance but declares no GPU resources"),
    ("spot nodes without the preemption watcher", lambda c: c.update(worker_start_ray_commands=[
        cmd for cmd in c["worker_start_ray_commands"] if "spot-watch" not in cmd]),
     r"gpu_a100x8_spot.node_config.*a spot node type, and worker_start_ray_commands do not start `behemoth "
     r"spot-watch`"),
    ("launcher-made security group", lambda c: c["available_node_types"]["head_cpu"]["node_config"].pop("SecurityGroupIds"),
     r"head_cpu.node_config.*SSH open to 0.0.0.0/0"),
]


@pytest.mark.parametrize("name,edit,expected", CASES, ids=[c[0] for c in CASES])
def test_each_mutation_is_rejected_with_its_reason(tmp_path, capsys, name, edit, expected):
    path = mutated(tmp_path, edit)
    assert main(["check-cluster", str(path)]) == 1
    err = capsys.readouterr().err
    assert re.search(expected, err), err


def test_findings_carry_line_numbers(tmp_path):
    path = mutated(tmp_path, lambda c: c["available_node_types"]["gpu_a100x8"].update(resources={"CPU": 96}))
    (finding,) = check_cluster(path)
    line = path.read_text().splitlines()[finding.line - 1]
    assert line.strip().startswith("resources:")


def test_local_storage_path_on_a_multi_node_cluster(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("data:\n  root: /data/imagenet\ncheckpoint:\n  storage_path: /home/ubuntu/runs\n")
    cluster = mutated(tmp_path, lambda c: None)
    assert "'/home/ubuntu/runs' is a local path on a multi-node cluster" in messages(cluster, [str(job)])
    job.write_text("data:\n  root: /data/imagenet\ncheckpoint:\n  storage_path: s3://bucket/runs\n")
    assert messages(cluster, [str(job)]) == ""


def _one_line(path, capsys) -> str:
    assert main(["check-cluster", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("edit, key", [
    (lambda t: re.sub(r'^  ("~/(behemoth|\.ray/auth_token)")', r"  # \1", t, flags=re.M), "file_mounts"),
    (lambda t: t + "docker:\n", "docker"),
    (lambda t: re.sub(r"^provider:\n(  .*\n)+", "provider:\n", t, flags=re.M), "provider"),
])
def test_an_empty_section_is_refused_in_one_line_naming_it_before_ray_reads_it(tmp_path, capsys, edit, key):
    """`file_mounts:` with every entry commented out, an empty `docker:` or `provider:`: Ray's prepare_config
    failed on them with "AttributeError: 'NoneType' object has no attribute ..."."""
    path = tmp_path / "cluster.yaml"
    path.write_text(edit(filled(CLUSTER.read_text())))
    assert f"cluster.yaml: {key} (line " in _one_line(path, capsys)
    assert "is empty (nothing after its colon, or every entry commented out)" in messages(path)


@pytest.mark.parametrize("rule, says", [
    ({"FromPort": "22", "ToPort": 22, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]},
     "IpPermissions[0].FromPort (line N): '22' is not a port number. Fix: write it as an integer: FromPort: 22"),
    ({"FromPort": 22, "ToPort": 22, "IpProtocol": "tcp", "IpRanges": ["0.0.0.0/0"]},
     "IpPermissions[0].IpRanges (line N): ['0.0.0.0/0'] is not a list of mappings"),
    ("tcp 22 0.0.0.0/0", "IpPermissions[0] (line N): 'tcp 22 0.0.0.0/0' is not a rule"),
])
def test_a_security_group_rule_not_in_ec2s_shape_is_one_line_naming_it(tmp_path, capsys, rule, says):
    path = mutated(tmp_path, lambda c: c["provider"].update(security_group={"GroupName": "x", "IpPermissions": [rule]}))
    assert says in re.sub(r"\(line \d+\)", "(line N)", _one_line(path, capsys))


def test_a_kuberay_manifest_beside_other_documents_is_checked_and_a_file_of_several_configs_refused(tmp_path,
                                                                                                     capsys):
    """`kubectl apply -f` takes several documents: the RayClusters and RayJobs among them are checked (a
    ConfigMap beside a RayCluster was refused as not valid YAML, over several lines); a file of several documents
    none of which is a KubeRay manifest is refused in one line."""
    manifest = (REPO / "deploy/kuberay/resnet50-8gpu-raycluster.yaml").read_text()
    config_map = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: settings}\ndata: {a: b}\n"
    path = tmp_path / "cluster.yaml"
    path.write_text(manifest + "---\n" + config_map)
    assert main(["check-cluster", str(path)]) == 0
    path.write_text(config_map + "---\n" + manifest.replace("mode: token", "mode: disabled"))
    assert "cluster.yaml: document 2 of 2: spec.authOptions.mode: Ray's token auth is off" in _one_line(path, capsys)
    path.write_text(config_map + "---\n" + config_map)
    assert "holds 2 YAML documents and none is a KubeRay RayCluster or RayJob" in _one_line(path, capsys)

"""check-cluster: Ray's schema offline, then security lints; each mutation of cluster.yaml is named."""

import re
from pathlib import Path

import pytest
import yaml

from behemoth.driver.cli import main
from behemoth.driver.cluster_check import check_cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster.yaml"


def mutated(tmp_path, edit) -> Path:
    cfg = yaml.safe_load(CLUSTER.read_text())
    edit(cfg)
    out = tmp_path / "cluster.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def messages(path, jobs=None) -> str:
    return "\n".join(str(f) for f in check_cluster(path, jobs))


def test_shipped_cluster_yaml_passes(capsys):
    assert check_cluster(CLUSTER) == []
    assert main(["check-cluster", str(CLUSTER), "--job", str(REPO / "jobs/configs/resnet50_imagenet_8gpu.yaml")]) == 0
    assert "OK" in capsys.readouterr().out


def _open_port(cfg, port_from, port_to, cidr="0.0.0.0/0"):
    cfg["provider"]["security_group"] = {"GroupName": "x", "IpPermissions": [
        {"FromPort": 22, "ToPort": 22, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "10.0.0.0/8"}]},
        {"FromPort": port_from, "ToPort": port_to, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": cidr}]}]}


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
    ("no token auth on workers", _drop_token, r"worker_start_ray_commands.*starts Ray without token authentication"),
    ("token not mounted", lambda c: c["file_mounts"].pop("~/.ray/auth_token"),
     r"file_mounts.*auth token ~/.ray/auth_token is not mounted"),
    ("dashboard bound to 0.0.0.0", lambda c: c.pop("head_start_ray_commands"),
     r"dashboard binds to 0.0.0.0"),
    ("GPU node without GPUs", lambda c: c["available_node_types"]["gpu_a100x8"].update(resources={"CPU": 96}),
     r"gpu_a100x8.resources.*p4d.24xlarge is a GPU instance but declares no GPU resources"),
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
    assert "'/home/ubuntu/runs' is a local path on a multi-node cluster" in messages(CLUSTER, [str(job)])
    job.write_text("data:\n  root: /data/imagenet\ncheckpoint:\n  storage_path: s3://bucket/runs\n")
    assert messages(CLUSTER, [str(job)]) == ""

"""`ray job submit` end to end against a real `ray start --head` on loopback with token auth on.

The cluster has its own temp dir, ports and token file, and is stopped afterwards, even when a test fails, by
ending the `ray start --block` process that owns it (never `ray stop`, which ends every Ray on the machine).
"""

import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import job_dict

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_without_behemoth(folder: Path) -> Path:
    """A virtual environment with every package of this one except behemoth: its site-packages folder is on
    the path through a .pth line, and a folder added that way has its own .pth files (among them the
    editable install's, which puts platform/ on the path) ignored. A cluster started with it is a cluster
    without behemoth installed: its workers get the package only through the job's py_modules."""
    import site
    import venv

    venv.create(folder, with_pip=False)
    target = next(folder.glob("lib/python*/site-packages"))
    (target / "parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return folder / "bin" / "python"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node on 127.0.0.1 with token auth, on a Python without behemoth; yields (dashboard address,
    env for the ray CLI, whose `python` is that Python)."""
    import secrets
    import shutil
    import tempfile

    home = tmp_path_factory.mktemp("cluster")
    python = python_without_behemoth(home / "env")
    hidden = subprocess.run([str(python), "-c", "import behemoth"], capture_output=True, text=True)
    assert hidden.returncode != 0 and "No module named 'behemoth'" in hidden.stderr, hidden.stderr
    token = home / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_ADDRESS", None)
    # As a user who started Ray from their activated environment: the job's `python` is that environment's.
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    gcs_port, dash_port, agent_port = _free_port(), _free_port(), _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayh-")  # short: Ray's socket paths have a length limit
    # Ray runs its daemons and workers with the interpreter that ran `ray start`. With --block the command
    # stays in the foreground, owns every process it started and ends them all when it is terminated: the
    # fixture stops this cluster and nothing else (`ray stop` would end every Ray process on the machine).
    start = [str(python), str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}", "--num-cpus=2",
             # its job agent's own port: the default one is taken where another Ray runs on the machine (the suite's
             # bystander, a user's), and an agent without its port takes no job ("No available agent")
             f"--dashboard-agent-listen-port={agent_port}",
             f"--temp-dir={temp_dir}", "--disable-usage-stats", "--include-dashboard=true", "--block"]
    # (Ray 2.60's `ray start --block` drains its node for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s, when it is
    # terminated, for Serve's replicas: this cluster has none, and the wait was half the module's time)
    head = subprocess.Popen(start, env={**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash_port}"
    try:
        _wait_for_job_api(address, head)
        _wait_for_job_agent(address, env)
        yield address, env
    finally:
        head.terminate()
        head.wait(timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_job_api(address: str, head: subprocess.Popen, limit_s: float = 180) -> None:
    """Until the dashboard's job API answers (401 without a token: it is up)."""
    import time

    deadline = time.time() + limit_s
    while True:
        assert head.poll() is None, f"`ray start --head` ended with {head.returncode}"
        try:
            urllib.request.urlopen(f"{address}/api/jobs/", timeout=5)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            assert time.time() < deadline, f"the job API at {address} did not answer within {limit_s} s"
            time.sleep(0.5)


def _wait_for_job_agent(address: str, env: dict, limit_s: float = 180) -> None:
    """Until the head node's job agent takes a job (a no-op one): the job API answers before the agent has
    registered, and a job submitted then is refused ("No available agent to submit job, please try again later")."""
    import time

    deadline = time.time() + limit_s
    while True:
        probe = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", address, "--no-wait", "--",
                                "python", "-c", "pass"], env=env, capture_output=True, text=True, timeout=120)
        if probe.returncode == 0:
            return
        said = probe.stdout + probe.stderr
        assert "No available agent" in said and time.time() < deadline, said[-3000:]
        time.sleep(1)


def _submit(address, env, cwd, config_path, *overrides):
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
           "python", "jobs/train.py", "--config", str(config_path)] + [f"--set={o}" for o in overrides]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=400)


def test_job_api_refuses_missing_and_wrong_tokens(cluster):
    address, *_ = cluster
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=30)
    assert missing.value.code == 401
    wrong = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": "Bearer " + "0" * 64})
    with pytest.raises(urllib.error.HTTPError) as forbidden:
        urllib.request.urlopen(wrong, timeout=30)
    assert forbidden.value.code == 403


def test_submitted_job_trains_and_a_bad_config_fails(cluster, image_root, tmp_path):
    address, env = cluster
    outside = tmp_path / "elsewhere"  # submit from a folder outside the repository
    outside.mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_dict(image_root, tmp_path / "runs", "submitted", train={"max_steps": 4})))

    ok = _submit(address, env, outside, config)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "[behemoth] epoch" in ok.stdout and "[behemoth] run finished" in ok.stdout
    checkpoints = [p for p in (tmp_path / "runs" / "submitted").glob("checkpoint_*") if p.is_dir()]
    assert checkpoints and all((p / "manifest.json").is_file() for p in checkpoints)

    bad = _submit(address, env, outside, config, "train.lr=-1")
    assert bad.returncode != 0
    assert "config error" in bad.stdout + bad.stderr and "train.lr must be > 0" in bad.stdout + bad.stderr
    assert re.search(r"Job 'raysubmit_\w+' failed", bad.stdout + bad.stderr)  # the job's status, not just the CLI's

    # checkpoints into the uploaded copy of the working dir (Ray deletes it): refused, naming the fix
    lost = _submit(address, env, outside, config, "checkpoint.storage_path=runs")
    said = lost.stdout + lost.stderr
    assert lost.returncode != 0 and "checkpoint.storage_path 'runs' is a relative path" in said, said[-3000:]
    assert "--set checkpoint.storage_path=$PWD/runs" in said

"""`behemoth spot-watch`: one per node of a spot cluster (cluster.yaml's start commands run it in the background).
It polls the cloud's preemption notice for this instance and, once one arrives, drains this node through Ray
(reason preemption, the notice's deadline): Ray Train's preemption watcher then tells the worker group, behemoth
checkpoints at its next report step and holds until the deadline (worker/reporting.py), and the run resumes from that
checkpoint on the nodes it gets next. Ray's open-source autoscaler reads neither cloud's notice itself.

- AWS (EC2 spot): the instance metadata service, IMDSv2 (a session token from PUT /latest/api/token, sent with
  every read): /latest/meta-data/spot/instance-action is 404 until an interruption is scheduled, then
  {"action": "terminate" | "stop" | "hibernate", "time": "<UTC ISO time>"}, about two minutes ahead.
- GCE (spot / preemptible VMs): /computeMetadata/v1/instance/preempted (header Metadata-Flavor: Google) turns
  TRUE when the VM is being preempted; the VM then has ~30 s (its ACPI soft-off), taken as the deadline.

Silent while no notice comes (one metadata read per --interval seconds); one line when it acts; then it exits.
A metadata service that cannot be reached at the start is an error naming it (the wrong --cloud, or not on a
cloud); later read errors are retried quietly.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from behemoth.errors import ConfigError

AWS_METADATA, GCE_METADATA = "http://169.254.169.254", "http://metadata.google.internal"
GCE_NOTICE_S = 30.0  # a preempted GCE VM's time between the notice and its stop
TOKEN_TTL_S = 21600  # IMDSv2 session tokens live up to 6 hours; renewed a minute before


@dataclass(frozen=True)
class Notice:
    cloud: str
    deadline: float  # epoch seconds: when the instance goes
    detail: str  # what the cloud said


class AwsNotice:
    """EC2's spot interruption notice, read through IMDSv2."""

    cloud = "aws"

    def __init__(self, base: str = AWS_METADATA, timeout_s: float = 2.0):
        self.base, self.timeout_s = base.rstrip("/"), timeout_s
        self.token, self.token_until = None, 0.0

    def _token(self, renew: bool = False) -> str:
        if renew or self.token is None or time.time() > self.token_until:
            request = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                             headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                self.token = response.read().decode()
            self.token_until = time.time() + TOKEN_TTL_S - 60
        return self.token

    def read(self) -> Notice | None:
        for renew in (False, True):  # a 401: the token expired early (the service restarted): once more
            request = urllib.request.Request(f"{self.base}/latest/meta-data/spot/instance-action",
                                             headers={"X-aws-ec2-metadata-token": self._token(renew)})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    body = response.read().decode()
                break
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None  # no interruption scheduled
                if e.code != 401 or renew:
                    raise
        action = json.loads(body)
        when = datetime.datetime.fromisoformat(action["time"].replace("Z", "+00:00")).timestamp()
        return Notice(self.cloud, when, f"spot instance-action {action.get('action')} at {action['time']}")


class GceNotice:
    """GCE's preemption flag, read from the metadata server."""

    cloud = "gce"

    def __init__(self, base: str = GCE_METADATA, timeout_s: float = 2.0):
        self.base, self.timeout_s = base.rstrip("/"), timeout_s

    def read(self) -> Notice | None:
        request = urllib.request.Request(f"{self.base}/computeMetadata/v1/instance/preempted",
                                         headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            flag = response.read().decode().strip()
        if flag != "TRUE":
            return None
        return Notice(self.cloud, time.time() + GCE_NOTICE_S, f"instance/preempted TRUE (about {GCE_NOTICE_S:.0f} s left)")


SOURCES = {"aws": (AwsNotice, AWS_METADATA), "gce": (GceNotice, GCE_METADATA)}


def source(cloud: str, metadata_url: str | None = None):
    if cloud not in SOURCES:
        raise ConfigError(f"--cloud {cloud!r}: one of {', '.join(SOURCES)}")
    cls, default = SOURCES[cloud]
    return cls(metadata_url or default)


def wait_for_notice(reader, interval_s: float, stop_after_s: float | None = None) -> Notice | None:
    """Poll until a notice comes (returned), or `stop_after_s` passes (None). The first read must succeed: a
    metadata service this node cannot reach is a ConfigError naming it."""
    try:
        notice = reader.read()
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"the {reader.cloud} metadata service at {reader.base} cannot be read ({e}): is this "
                          f"node on {reader.cloud}, and is --cloud right?") from None
    began = time.monotonic()
    while notice is None:
        if stop_after_s is not None and time.monotonic() - began > stop_after_s:
            return None
        time.sleep(interval_s)
        try:
            notice = reader.read()
        except (OSError, ValueError, KeyError):
            notice = None  # a read that failed: the next one tells
    return notice


def own_node(address: str, node_id: str | None) -> str:
    """This node's Ray node id: `node_id`, or the one alive node whose raylet listens on this host's address."""
    from behemoth.ray_internals.core import alive_nodes_at

    if node_id:
        return node_id
    ip = _this_ip()
    found = alive_nodes_at(address, ip)
    if len(found) != 1:
        raise ConfigError(f"{len(found)} alive Ray nodes listen on {ip}: give --node-id (this node's id, "
                          f"`ray list nodes`)" if found else f"no alive Ray node listens on {ip}: start the "
                          f"watcher after `ray start` on this node")
    return found[0]


def _this_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def run(cloud: str, metadata_url: str | None, address: str | None, node_id: str | None, interval_s: float) -> int:
    """The command: watch, drain once, say so in one line. Exit 0 after draining, 1 if GCS refused the drain."""
    from behemoth.ray_internals.core import drain_for_preemption, gcs_address

    reader = source(cloud, metadata_url)
    gcs = gcs_address(address)
    node = own_node(gcs, node_id)
    notice = wait_for_notice(reader, interval_s)
    accepted, why = drain_for_preemption(gcs, node, f"{cloud} preemption: {notice.detail}", notice.deadline)
    left = notice.deadline - time.time()
    if not accepted:
        print(f"[behemoth spot-watch] {socket.gethostname()}: {notice.detail}; Ray refused to drain node {node}: "
              f"{why}", file=sys.stderr, flush=True)
        return 1
    print(f"[behemoth spot-watch] {socket.gethostname()}: {notice.detail}; drained Ray node {node} for preemption, "
          f"{left:.0f} s to the deadline", flush=True)
    return 0

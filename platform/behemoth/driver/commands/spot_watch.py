"""`behemoth spot-watch`: one per node of a spot cluster (cluster.yaml's start commands run it in the background).
It polls the cloud's preemption notice for this instance and, once one arrives, drains this node through Ray
(reason preemption, the notice's deadline): Ray Train's preemption watcher then tells the worker group, behemoth
checkpoints at its next report step, trains on through the notice and checkpoints again just before the deadline
(worker/reporting.py), and the run resumes from that checkpoint on the nodes it gets next. Ray's open-source autoscaler reads neither cloud's notice itself.

- AWS (EC2 spot): the instance metadata service, IMDSv2 (a session token from PUT /latest/api/token, sent with
  every read): /latest/meta-data/spot/instance-action is 404 until an interruption is scheduled, then
  {"action": "terminate" | "stop" | "hibernate", "time": "<UTC ISO time>"}, about two minutes ahead.
- GCE (spot / preemptible VMs): /computeMetadata/v1/instance/preempted (header Metadata-Flavor: Google) turns
  TRUE when the VM is being preempted; the VM then has ~30 s (its ACPI soft-off), taken as the deadline.

Silent while no notice comes (one metadata read per --interval seconds); one line when it acts; then it exits.
A metadata service that cannot be reached at the start is an error naming it (the wrong --cloud, or not on a
cloud); later read errors are retried quietly. What the service says is bounded: each read, all of it, within its
deadline and MAX_ANSWER_BYTES; a notice that is not one (a list, a numeric `time`, JSON nested past Python's
recursion limit) is one line naming what was sent, and the watch goes on; a deadline further ahead than
MAX_NOTICE_AHEAD_S, or already past, is moved into [now, now + MAX_NOTICE_AHEAD_S], said in the line.
"""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import json
import math
import os
import re
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass

from behemoth.errors import ConfigError
from behemoth.driver.commands.args import positive

AWS_METADATA, GCE_METADATA = "http://169.254.169.254", "http://metadata.google.internal"
GCE_NOTICE_S = 30.0  # a preempted GCE VM's time between the notice and its stop
TOKEN_TTL_S = 21600  # IMDSv2 session tokens live up to 6 hours; renewed a minute before
# The furthest ahead a notice's deadline is believed: EC2 gives two minutes, GCE 30 s; ten minutes leaves room for
# a clock minutes off and a cloud that warns earlier. A deadline further ahead (a service answering a year ahead:
# Ray drained the node, and the run held, for that year) is taken as this far, not refused: only the instance's
# own metadata service answers, so a notice is most likely real, and acting on it costs a checkpoint and a
# restart where ignoring a real one loses the steps since the last checkpoint.
MAX_NOTICE_AHEAD_S = 600.0
MAX_ANSWER_BYTES = 65536  # a notice is ~80 bytes, a token 56: an answer longer is no notice, and is not read on
NO_WHOLE_ANSWER = "no whole answer within the read's deadline"
READ_ERRORS = (OSError, ValueError, http.client.HTTPException)  # a read that failed: unreachable, cut, timed out


@dataclass(frozen=True)
class Notice:
    cloud: str
    deadline: float  # epoch seconds: when the instance goes
    detail: str  # what the cloud said


class MalformedNotice(Exception):
    """The service answered with a notice, but not one this watcher can read: what it sent, and what is wrong."""


def bounded(notice: Notice, now: float) -> Notice:
    """The notice with its deadline within [now, now + MAX_NOTICE_AHEAD_S], its detail saying where it was moved
    (a `time` in 1900 is a deadline Ray refuses to drain with: taken as now)."""
    ahead = notice.deadline - now
    if ahead > MAX_NOTICE_AHEAD_S:
        moved, why = now + MAX_NOTICE_AHEAD_S, (f"{ahead:.0f} s ahead, more than any cloud's notice: taken as "
                                                f"{MAX_NOTICE_AHEAD_S:.0f} s")
    elif ahead < 0:
        moved, why = now, f"{-ahead:.0f} s ago: taken as now"
    else:
        return notice
    return dataclasses.replace(notice, deadline=moved, detail=f"{notice.detail} ({why})")


class _DeadlineSocket(socket.socket):
    """A socket whose every receive waits only for what is left until `deadline` (time.monotonic()): a socket
    timeout bounds each receive alone, so a server sending a byte a second held a read for as long as it went on."""

    deadline = math.inf

    def recv_into(self, buffer, nbytes=0, flags=0):
        self.settimeout(_left(self.deadline))
        return super().recv_into(buffer, nbytes, flags)


def _request(url: str, deadline: float, headers: dict, method: str = "GET") -> tuple[int, bytes]:
    """(status, body) of one request to the metadata service: connecting, the headers and the body all before
    `deadline` (time.monotonic()), at most MAX_ANSWER_BYTES + 1 of the body read. Plain HTTP to the service's own
    address: no proxy from the environment (it would answer with its own instance's metadata), no redirect."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80)
    try:
        plain = socket.create_connection((parts.hostname, parts.port or 80), timeout=_left(deadline))
        connection.sock = _DeadlineSocket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        connection.sock.deadline = deadline
        connection.sock.settimeout(_left(deadline))  # (sending the request)
        connection.request(method, parts.path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(MAX_ANSWER_BYTES + 1)
    except TimeoutError:  # (the socket's own, "timed out", or the deadline's)
        raise TimeoutError(NO_WHOLE_ANSWER) from None
    finally:
        connection.close()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(NO_WHOLE_ANSWER)
    return left


def instance_action(body: bytes) -> tuple[str, str, float]:
    """(action, time as sent, epoch seconds) from EC2's instance-action answer: one JSON object whose `time` is an
    ISO time (UTC where it names no zone); anything else is MalformedNotice naming what was sent (a list, a
    numeric `time` or JSON nested past the recursion limit ended the watcher, leaving its node unwatched)."""
    sent = repr(body[:100].decode("utf-8", "replace")) + ("..." if len(body) > 100 else "")
    if len(body) > MAX_ANSWER_BYTES:
        raise MalformedNotice(f"more than {MAX_ANSWER_BYTES} bytes, beginning {sent}")
    try:
        action = json.loads(body)
    except (ValueError, RecursionError):
        raise MalformedNotice(f"{sent}: not JSON") from None
    when = action.get("time") if isinstance(action, dict) else None
    if not isinstance(when, str):
        raise MalformedNotice(f"{sent}: not a JSON object with a string 'time'")
    try:
        parsed = datetime.datetime.fromisoformat(when.replace("Z", "+00:00"))
        if parsed.tzinfo is None:  # (EC2's times are UTC)
            parsed = parsed.replace(tzinfo=datetime.timezone.utc)
        epoch_s = parsed.timestamp()
    except (ValueError, OverflowError):
        raise MalformedNotice(f"{sent}: its 'time' is not an ISO time") from None
    kind = action.get("action")  # (said in the one line: a plain word, else its repr, short either way)
    return (kind if isinstance(kind, str) and kind.isprintable() else repr(kind))[:40], when, epoch_s


class AwsNotice:
    """EC2's spot interruption notice, read through IMDSv2: each read, its token's request included, within
    `timeout_s`."""

    cloud = "aws"

    def __init__(self, base: str = AWS_METADATA, timeout_s: float = 2.0):
        self.base, self.timeout_s = base.rstrip("/"), timeout_s
        self.token, self.token_until = None, 0.0

    def _token(self, deadline: float, renew: bool = False) -> str:
        if renew or self.token is None or time.time() > self.token_until:
            status, body = _request(f"{self.base}/latest/api/token", deadline, method="PUT",
                                    headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status != 200 or len(body) > MAX_ANSWER_BYTES:
                raise ConnectionError(f"no IMDSv2 token (HTTP {status}, {len(body)} bytes)")
            self.token = body.decode()
            self.token_until = time.time() + TOKEN_TTL_S - 60
        return self.token

    def read(self) -> Notice | None:
        deadline = time.monotonic() + self.timeout_s
        for renew in (False, True):  # a 401: the token expired early (the service restarted): once more
            status, body = _request(f"{self.base}/latest/meta-data/spot/instance-action", deadline,
                                    headers={"X-aws-ec2-metadata-token": self._token(deadline, renew)})
            if status == 404:
                return None  # no interruption scheduled
            if status == 200:
                break
            if status != 401 or renew:
                raise ConnectionError(f"HTTP {status} from spot/instance-action")
        action, when, epoch_s = instance_action(body)
        return Notice(self.cloud, epoch_s, f"spot instance-action {action} at {when}")


class GceNotice:
    """GCE's preemption flag, read from the metadata server within `timeout_s`."""

    cloud = "gce"

    def __init__(self, base: str = GCE_METADATA, timeout_s: float = 2.0):
        self.base, self.timeout_s = base.rstrip("/"), timeout_s

    def read(self) -> Notice | None:
        status, body = _request(f"{self.base}/computeMetadata/v1/instance/preempted",
                                time.monotonic() + self.timeout_s, headers={"Metadata-Flavor": "Google"})
        if status != 200:
            raise ConnectionError(f"HTTP {status} from instance/preempted")
        if body.decode("utf-8", "replace").strip() != "TRUE":
            return None
        return Notice(self.cloud, time.time() + GCE_NOTICE_S, f"instance/preempted TRUE (about {GCE_NOTICE_S:.0f} s left)")


SOURCES = {"aws": (AwsNotice, AWS_METADATA), "gce": (GceNotice, GCE_METADATA)}


def source(cloud: str, metadata_url: str | None = None):
    if cloud not in SOURCES:
        raise ConfigError(f"--cloud {cloud!r}: one of {', '.join(SOURCES)}")
    cls, default = SOURCES[cloud]
    url = metadata_url or default
    try:  # (the watcher speaks plain HTTP to a service on the instance's own network: nothing else is one)
        parts = urllib.parse.urlsplit(url)
        plain = parts.scheme == "http" and bool(parts.hostname) and parts.port != 0 and not parts.query
    except ValueError:  # (a port out of range)
        plain = False
    if not plain:
        raise ConfigError(f"--metadata-url {url!r}: give the metadata service's plain HTTP address, http://HOST[:PORT]")
    return cls(url)


def _say(message: str, error: bool = False) -> None:
    print(f"[behemoth spot-watch] {socket.gethostname()}: {message}", file=sys.stderr if error else sys.stdout,
          flush=True)


def _read(reader, said: list[str]) -> Notice | None:
    """One read; a malformed notice is one line naming what the service sent (once until it sends another), and
    no notice: the watch goes on (a cloud's notice is a JSON object; the next read may bring one)."""
    try:
        return reader.read()
    except MalformedNotice as e:
        if str(e) not in said:
            said[:] = [str(e)]
            _say(f"the {reader.cloud} metadata service at {reader.base} sent a notice this watcher cannot read "
                 f"({e}); watching on", error=True)
        return None


def wait_for_notice(reader, interval_s: float, stop_after_s: float | None = None) -> Notice | None:
    """Poll until a notice comes (returned, its deadline bounded), or `stop_after_s` passes (None). The first read
    must reach the service: one this node cannot reach is a ConfigError naming it."""
    said: list[str] = []
    try:
        notice = _read(reader, said)
    except READ_ERRORS as e:
        raise ConfigError(f"the {reader.cloud} metadata service at {reader.base} cannot be read ({e}): is this "
                          f"node on {reader.cloud}, and is --cloud right?") from None
    began = time.monotonic()
    while notice is None:
        if stop_after_s is not None and time.monotonic() - began > stop_after_s:
            return None
        time.sleep(interval_s)
        try:
            notice = _read(reader, said)
        except READ_ERRORS:
            notice = None  # a read that failed: the next one tells
    return bounded(notice, time.time())


def own_node(address: str, node_id: str | None) -> str:
    """This node's Ray node id: `node_id`, or the one alive node whose raylet listens on this host's address."""
    import ray

    from behemoth.ray_internals.core import alive_nodes_at

    if node_id is not None:
        # Ray reads a malformed id as the nil id and logs; GCS then accepts the drain of that (dead) node: the
        # watcher said "drained" while its own node trained on, unwarned
        if not re.fullmatch(f"[0-9a-fA-F]{{{2 * ray.NodeID.size()}}}", node_id):
            raise ConfigError(f"--node-id {node_id!r} is not a Ray node id ({2 * ray.NodeID.size()} hex digits): "
                              f"copy this node's from `ray list nodes`, or leave --node-id out")
        alive = alive_nodes_at(address, None)  # (a mistyped id would be found out only at a notice's drain)
        if node_id.lower() not in alive:
            shown = ", ".join(alive[:4]) + (f" and {len(alive) - 4} more" if len(alive) > 4 else "")
            raise ConfigError(f"--node-id {node_id} names no alive node of the cluster at {address} (alive: "
                              f"{shown or 'none'}): copy this node's id from `ray list nodes`, or leave --node-id out")
        return node_id.lower()
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
    from behemoth.ray_internals.core import drain_for_preemption

    reader = source(cloud, metadata_url)
    gcs = _gcs(address)
    node = own_node(gcs, node_id)
    notice = wait_for_notice(reader, interval_s)
    accepted, why = drain_for_preemption(gcs, node, f"{cloud} preemption: {notice.detail}", notice.deadline)
    left = notice.deadline - time.time()
    if not accepted:
        _say(f"{notice.detail}; Ray refused to drain node {node}: {why}", error=True)
        return 1
    _say(f"{notice.detail}; drained Ray node {node} for preemption, {left:.0f} s to the deadline")
    return 0


def _gcs(address: str | None) -> str:
    """The cluster's GCS address, host:port: `address`, or this node's `ray start` (RAY_ADDRESS where set)."""
    from behemoth.ray_internals.core import gcs_address

    if address is not None:
        host, _, port = address.rpartition(":")
        if not (host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"--address {address!r}: give the cluster's GCS address as HOST:PORT (the head's "
                              f"`ray start --port`, 6379 by default), or leave it out on a node Ray runs on")
    try:
        return gcs_address(address)
    except ConnectionError as e:  # (none running here, or several: Ray's first sentence says which)
        raise ConfigError(f"{str(e).split('. ')[0]} on this node: start the watcher after `ray start` on this node "
                          f"(as cluster.yaml's worker_start_ray_commands do), or give --address HOST:PORT") from None
    except ValueError as e:  # (a host Ray refuses; or RAY_ADDRESS, read where --address is not given)
        culprit = f"--address {address!r}" if address is not None else f"RAY_ADDRESS {os.environ.get('RAY_ADDRESS')!r}"
        raise ConfigError(f"{culprit}: {e}: give the cluster's GCS address as HOST:PORT") from None


# `spot-watch --interval`: at most 30 s, GCE's whole notice (a longer interval could read a notice after its VM is
# gone; -1 or nan ended the watcher at its first sleep, 0 asks the service without pause)
_poll_interval = positive("seconds between two reads", 30)


def add_command(sub) -> None:
    p = sub.add_parser("spot-watch", help="on a spot node (cluster.yaml starts it after `ray start`): wait for the "
                       "cloud's preemption notice, then drain this Ray node with its deadline, so the run checkpoints "
                       "before the node goes (docs/clusters.md)")
    p.add_argument("--cloud", choices=["aws", "gce"], required=True, help="whose metadata service to read")
    p.add_argument("--metadata-url", help="the metadata service's plain HTTP address, http://HOST[:PORT] (default: "
                   "the cloud's own)")
    p.add_argument("--address", help="the cluster's GCS address, host:port (default: this node's `ray start`)")
    p.add_argument("--node-id", help="this node's Ray node id (default: the node listening on this host's address)")
    p.add_argument("--interval", type=_poll_interval, default=5.0, help="seconds between two reads of the notice, "
                   "more than 0 and at most 30 (default 5)")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    return run(args.cloud, args.metadata_url, args.address, args.node_id, args.interval)

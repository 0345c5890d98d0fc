"""Ray core's internals behemoth relies on. Read against Ray 2.60.0 (ray/_private/worker.py, state.py,
ray_logging.py, authentication/authentication_token_setup.py; ray/autoscaler/_private/util.py;
ray/core/generated/gcs_pb2).

On a Ray upgrade: the global node's log folder, the GCS state accessor and its placement-group table, the
per-line hook for worker output, the token-auth logger's name, the autoscaler's config preparation.
"""

from __future__ import annotations

import logging

TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def node_logs_dir() -> str | None:
    """This process's Ray node's log folder (where workers' .err files are), or None outside a Ray node."""
    import ray._private.worker

    node = ray._private.worker._global_node
    return node.get_logs_dir_path() if node else None


def gcs_state():
    """Ray's GlobalState of this process's cluster (its job, actor and placement-group tables)."""
    from ray._private.state import state

    return state


def placement_group_table() -> list:
    """Every placement group GCS knows, as gcs_pb2.PlacementGroupTableData messages."""
    from ray.core.generated import gcs_pb2

    raw = gcs_state()._connect_and_get_accessor().get_placement_group_table()
    return [gcs_pb2.PlacementGroupTableData.FromString(r) for r in raw]


def placement_group_removed(pg) -> bool:
    from ray.core.generated import gcs_pb2

    return pg.state == gcs_pb2.PlacementGroupTableData.REMOVED


def ray_logging():
    """Ray's module that prints worker output on the driver (its per-line filter hook)."""
    from ray._private import ray_logging as module

    return module


def token_auth_logger() -> logging.Logger:
    return logging.getLogger(TOKEN_AUTH_LOGGER)


def prepare_cluster_config(raw: dict) -> dict:
    """A `ray up` config with its provider's defaults merged, as `ray up` runs it."""
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(raw)


def validate_cluster_config(prepared: dict) -> None:
    from ray.autoscaler._private.util import validate_config

    validate_config(prepared)


# ---------------------------------------------------------------------------------------------------------
# Draining a node for preemption (ray/scripts/scripts.py `ray drain-node`, which calls itself developer-facing:
# the GCS call behind it, DrainNode with reason PREEMPTION and a deadline, is what autoscaler v2 sends)


def gcs_address(address: str | None) -> str:
    """The cluster's GCS address: `address` (host:port), or this node's cluster ("auto": `ray start` wrote it)."""
    from ray._private import services

    return services.canonicalize_bootstrap_address_or_die(address or "auto")


def alive_nodes_at(address: str, ip: str | None) -> list[str]:
    """The hex ids of the alive Ray nodes whose raylet listens on `ip` (None: every alive node's)."""
    from ray._raylet import GcsClient

    infos = GcsClient(address=address).get_all_node_info()
    return [node_id.hex() for node_id, info in infos.items()
            if info.state == 0 and ip in (None, info.node_manager_address)]


def drain_for_preemption(address: str, node_id: str, message: str, deadline_s: float) -> tuple[bool, str]:
    """Ask GCS to drain `node_id` because it is being preempted, the node going at `deadline_s` (epoch seconds):
    (accepted, GCS's reason where not). Ray Train's preemption watcher then tells the worker group."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    return GcsClient(address=address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), message,
        int(deadline_s * 1000))

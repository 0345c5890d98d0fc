"""A killed driver's resource request, withdrawn when its run is rerun.

Ray Train's controller registers its worker group's resources with Ray's autoscaling coordinator (one
detached actor per cluster) when it starts, and withdraws them when it ends. A controller that dies with its
driver (SIGKILL, `ray job stop`, a lost machine) never withdraws them: the coordinator keeps them reserved
for the request's lifetime, 180 s. A fixed-size run does not ask the coordinator before it starts, but an
elastic one (`scaling.num_workers: [min, max]`) starts only the workers its reservation covers: after a
killed driver, every elastic run on the cluster, the killed run's own rerun included, would wait with the
cluster idle until the dead request expires.

The recorder writes each controller's Ray Train run id to the run's timeline (`controller_start`); an
invocation with no `invocation_end` died with its driver, and the run lock (storage/runlock.py) makes sure
no other driver is using the run folder. So the rerun withdraws those invocations' requests before it starts,
and records that it did (`requests_withdrawn`), so that later reruns do not withdraw them again.
"""

from __future__ import annotations

import time

from behemoth.storage import paths
from behemoth.ray_internals.data import AUTOSCALING_COORDINATOR
from behemoth.tracking.records import TIMELINE, JsonlLog, read_jsonl

COORDINATOR, COORDINATOR_NAMESPACE = AUTOSCALING_COORDINATOR


def requester_ids_of_killed_invocations(timeline: list[dict]) -> list[str]:
    """The coordinator's requester ids of the controllers whose invocation has no end record (and whose
    request no rerun has withdrawn yet)."""
    ended = {e["invocation"] for e in timeline if e.get("event") == "invocation_end"}
    withdrawn = {i for e in timeline if e.get("event") == "requests_withdrawn" for i in e.get("requester_ids", [])}
    ids = [f"train-{e['ray_train_run_id']}" for e in timeline
           if e.get("event") == "controller_start" and e.get("invocation") not in ended]
    return [i for i in ids if i not in withdrawn]


def withdraw_killed_drivers_requests(run_dir: str, invocation: str) -> list[str]:
    """Withdraw the resource requests of this run's controllers that died with their driver; their
    requester ids. `invocation`: this one's id (for the record). Never fails the run: a coordinator that
    cannot be reached costs at most the wait."""
    import ray

    stale = requester_ids_of_killed_invocations(read_jsonl(paths.join(run_dir, TIMELINE)))
    if not stale:
        return []
    try:
        coordinator = ray.get_actor(COORDINATOR, namespace=COORDINATOR_NAMESPACE)
    except ValueError:
        return []  # no coordinator on this cluster (a new cluster): nothing is reserved
    try:
        ray.get([coordinator.cancel_request.remote(requester_id) for requester_id in stale], timeout=10)
    except Exception as e:  # noqa: BLE001 - see the docstring
        print(f"[behemoth] WARNING: could not withdraw the resource request of this run's killed driver "
              f"({type(e).__name__}: {e}); an elastic start may wait up to 3 minutes for it to expire", flush=True)
        return []
    JsonlLog(paths.join(run_dir, TIMELINE)).append({"time": time.time(), "event": "requests_withdrawn",
                                                     "invocation": invocation, "requester_ids": stale})
    print(f"[behemoth] withdrew the resource request of this run's killed driver ({', '.join(stale)}) from "
          f"Ray's autoscaling coordinator", flush=True)
    return stale

"""Placement groups a stopped trial can leave behind, freed while a sweep runs (read from GCS: no dashboard
needed)."""

from __future__ import annotations

import time


class OrphanedPlacementGroupReaper:
    """Frees the placement groups of this job whose creating actor is dead, while a sweep runs and once more
    after it (waiting up to `settle_s` for trial controllers still shutting down).

    A Ray Train race (Ray 2.60): when Tune stops a trial while its Ray Train controller is starting a worker
    group, the controller gets SIGTERM, stops its placement-group cleaner on the way out, and, still draining
    its control loop (an async actor), goes on to create the worker group's placement group, which GCS registers
    after the controller is dead. Nothing then owns that group: GCS removes a dead actor's group only once its
    job has ended too, so it holds a trial's CPUs for the rest of the sweep. A group whose creator actor is
    dead can never be used again, so removing it is safe; GCS says which (`creator_actor_dead`), no dashboard
    needed.
    """

    def __init__(self, every_s: float = 2.0, settle_s: float = 30.0, quiet_s: float = 3.0):
        import threading

        self.every_s, self.settle_s, self.quiet_s = every_s, settle_s, quiet_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="behemoth-pg-reaper", daemon=True)

    def __enter__(self):
        reap_orphaned_placement_groups()  # a killed driver's leftovers, before the first trial waits for CPUs
        self.thread.start()
        return self

    def __exit__(self, *exc):
        """Reap until no trial controller of this job is alive and none of their groups has turned up for
        `quiet_s`: a dying controller's last group request reaches GCS after the controller is already dead,
        so a reaper that stopped as soon as the last controller was gone could miss it."""
        self.done.set()
        self.thread.join()
        deadline, quiet_since = time.monotonic() + self.settle_s, None
        while time.monotonic() < deadline:
            if reap_orphaned_placement_groups() or _live_train_controllers():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= self.quiet_s:
                return
            time.sleep(0.2)
        reap_orphaned_placement_groups()

    def _run(self):
        while not self.done.wait(self.every_s):
            reap_orphaned_placement_groups()


def reap_orphaned_placement_groups() -> list[str]:
    """Remove the placement groups (not detached) whose creating actor is dead, of this job or of a job that
    has ended (a sweep driver killed before this one resumed it); their ids. Never another live job's."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    from behemoth.ray_internals.core import gcs_state, placement_group_removed, placement_group_table

    state = gcs_state()

    job = ray.get_runtime_context().get_job_id()
    ended = {j["JobID"] for j in state.job_table() if j.get("IsDead")}
    # The actor table, not the group's creator_actor_dead flag: GCS sets that flag when the creator dies, so a
    # group registered after its creator's death (the race above) never gets it. An ended job's group can also
    # stay CREATED with its creator dead.
    dead = {actor_id for actor_id, actor in state.actor_table(None).items() if actor.get("State") == "DEAD"}
    reaped = []
    for pg in placement_group_table():
        # A group the driver created (Tune's trial groups) has the nil creator actor, marked dead: never those.
        created_by_actor = pg.creator_actor_id and not ray.ActorID(pg.creator_actor_id).is_nil()
        ours_or_ended = pg.creator_job_id.hex() == job or pg.creator_job_id.hex() in ended
        if (not placement_group_removed(pg) and not pg.is_detached and created_by_actor
                and (pg.creator_actor_dead or pg.creator_actor_id.hex() in dead) and ours_or_ended):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(pg.placement_group_id)))
            reaped.append(pg.placement_group_id.hex())
            print(f"[behemoth] freed placement group {reaped[-1]}: its creator (a stopped trial's Ray Train "
                  f"controller) is dead", flush=True)
    return reaped


def _live_train_controllers() -> int:
    """Ray Train controllers of this job still alive (by GCS's actor table)."""
    import ray

    from behemoth.ray_internals.core import gcs_state

    job = ray.get_runtime_context().get_job_id()
    return sum(1 for a in gcs_state().actor_table(None).values()
               if a.get("State") == "ALIVE" and a.get("JobID") == job and a.get("ActorClassName", "").endswith("TrainController"))

"""Ray Train's placement-group cleaner, asking Ray's state API about its own cluster.

Ray Train 2.60 starts a PlacementGroupCleaner actor for every run: it frees the run's workers (their placement
group) if the run's controller dies without doing so (a trial that Tune stops). It asks the state API whether
the controller is alive without naming a cluster, and Ray then looks for one on the machine: where two Ray
instances run (a user's own beside behemoth's; the suite's bystander), it finds two GCS processes and raises;
the cleaner's monitor thread dies with a traceback and a stopped trial's workers are never freed. This cleaner
names its own cluster (RAY_ADDRESS, set in its own process only) before Ray Train's starts monitoring.
"""

from __future__ import annotations

import os

import ray

from behemoth.ray_internals.train_v2 import (PlacementGroupCleaner, PlacementGroupCleanerCallback,
                                          launch_placement_group_cleaner)


class ThisClusterCleaner(PlacementGroupCleaner):
    def __init__(self, *args, **kwargs):
        # the state API reads RAY_ADDRESS first (ray._private.services.get_ray_address_from_environment)
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        super().__init__(*args, **kwargs)


class ThisClusterCleanerCallback(PlacementGroupCleanerCallback):
    """Ray Train's callback, launching ThisClusterCleaner (in the run's controller, a process of its own)."""

    def after_controller_start(self, train_run_context):
        launch_placement_group_cleaner(ThisClusterCleaner)
        super().after_controller_start(train_run_context)

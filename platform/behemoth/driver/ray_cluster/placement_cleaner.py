"""Ray Train's placement-group cleaner, reading its run's controller's state from GCS.

Ray Train 2.60 starts a PlacementGroupCleaner actor for every run: it frees the run's workers (their placement
group) if the run's controller dies without doing so (a trial that Tune stops). It asks Ray's state API whether
the controller is alive, which needs the dashboard: without one (`ray start --include-dashboard=false`, or
`ray.init(include_dashboard=False)` before `behemoth.train`) it logged a warning to the console every second and
never freed anything; and without an address the state API looks for a cluster on the machine and raises where
two Ray instances run (a user's own beside behemoth's). This cleaner asks its own cluster's GCS instead
(ray_internals.train_v2.cleaner_reads_gcs), before Ray Train's starts monitoring.
"""

from __future__ import annotations

from behemoth.ray_internals.train_v2 import (PlacementGroupCleaner, PlacementGroupCleanerCallback,
                                          cleaner_reads_gcs, launch_placement_group_cleaner)


class ThisClusterCleaner(PlacementGroupCleaner):
    def __init__(self, *args, **kwargs):
        cleaner_reads_gcs()  # (this actor's process only)
        super().__init__(*args, **kwargs)


class ThisClusterCleanerCallback(PlacementGroupCleanerCallback):
    """Ray Train's callback, launching ThisClusterCleaner (in the run's controller, a process of its own)."""

    def after_controller_start(self, train_run_context):
        launch_placement_group_cleaner(ThisClusterCleaner)
        super().after_controller_start(train_run_context)

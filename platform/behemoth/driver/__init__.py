"""The driver's room: everything that runs in the process that starts a run, never touching CUDA, grouped by
concern the way Ray Train V2 groups its internals (docs/architecture.md says more):

- `commands/`: what the command line does besides training (`behemoth eval | export | generate | check-cluster |
  check-nodes | spot-watch | data bench`), the CLI itself among them
- `run/`: one run's sequence, from the job config to its summary, behind a launcher per way a run starts
  (Ray Train; a sweep's lane; evaluation)
- `ray_cluster/`: what the driver does with Ray: starting or joining it, its console, Ray Train's failure
  policy and placement-group cleaner, a killed driver's requests, the data processes' warm-up
- `sweep/`: a job's keys swept with Ray Tune, each trial a behemoth run (its own docstring)
"""

"""The driver's room: everything that runs in the process that starts a run (the CLI, the run's sequence, Ray's
session and console, the commands), never touching CUDA. Its modules (docs/architecture.md says more):

- `cleaner`: Ray Train's placement-group cleaner, naming its own cluster
- `cli`: `behemoth train | tune | eval | export | check | check-cluster | data | report`
- `cluster_check`: `behemoth check-cluster`: Ray's offline schema check + security lints
- `data_bench`: `behemoth data bench`: the input pipeline alone, can the CPUs feed the GPUs
- `evaluate`: `behemoth eval`: a checkpoint through the task's evaluation on Ray Train
- `export`: `behemoth export`: a checkpoint as a Hugging Face folder with a model card
- `failure_policy`: Ray Train's failure policy, plus: a data or config error is not retried
- `generate`: `behemoth generate`: a causal LM's completions (checkpoint or export; greedy or seeded
  sampling; chat template)
- `lease_fence`: the run lock's fence in Ray Train's workers, around each checkpoint upload
- `node_check`: `behemoth check-nodes`: a task pinned to each node checks the job's local paths
- `preflight`: before Ray: model / tokenizer sources (offline found once), init_from, tracking packages, an
  epoch's steps, train.profile's window
- `ray_console`: the filter on Ray's forwarded worker output: installed, lines held between batches
- `ray_console_scan`: what of Ray's output is noise (proven whole) and what is a real traceback (pure)
- `ray_session`: starts or joins Ray; the workers' environment; Ray Train's settings; warm-up
- `resume`: before a (re)run: the run's place, resume checks, init_from; after: retention
- `spot_watch`: `behemoth spot-watch`: on each spot node, the cloud's preemption notice (EC2 IMDSv2, GCE
  metadata) becomes a drain of the node through Ray
- `stale_requests`: a killed driver's resource request withdrawn when its run is rerun
- `summary`: RunSummary: what a finished run prints and the Python API returns
- `trainer`: config -> TorchTrainer -> fit -> summary; hands Ray Train the run's recorder
- `warmup`: the data pipeline's processes started while Ray Train starts its own
- `sweep/`: a job's keys swept with Ray Tune, each trial a behemoth run (its own docstring)
"""

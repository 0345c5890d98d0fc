"""The driver's commands: the command line and what it runs besides a training run. Each command's module adds
its own parser and holds what its arguments run; `cli` lists them.

- `cli`: the table of commands (`behemoth --help`'s order) and how an error ends the process
- `args`: the argument types and groups several commands take (a job config and --set; the trusted-code flags)
- `train`: `behemoth train`: a run on Ray, its summary printed
- `tune`: `behemoth tune`: a sweep with Ray Tune, its table and best trial printed
- `eval_checkpoint`: `behemoth eval`: a checkpoint evaluated with the job's data pipeline and workers
- `export`: `behemoth export`: a checkpoint as a Hugging Face folder with a model card
- `generate`: `behemoth generate`: a causal LM's completions (checkpoint or export; greedy or seeded sampling;
  chat template)
- `report`: `behemoth report`: a run's or a sweep's report written again
- `check`: `behemoth check`: a job (or a sweep) and its data checked without Ray
- `cluster_check`: `behemoth check-cluster`: Ray's offline schema check + security lints
- `kuberay_check`: the same command on a KubeRay RayCluster or RayJob: KubeRay's CRD schema (vendored) + rules
- `node_check`: `behemoth check-nodes`: a task pinned to each node checks the job's local paths
- `spot_watch`: `behemoth spot-watch`: on each spot node, the cloud's preemption notice (EC2 IMDSv2, GCE
  metadata) becomes a drain of the node through Ray
- `data_tools`: `behemoth data ...`: demo data, ImageNet's validation split, shards, a tokenizer, an image cache
- `data_bench`: `behemoth data bench`: the input pipeline alone, can the CPUs feed the GPUs
"""

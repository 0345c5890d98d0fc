"""The driver's commands: the command line and what it runs besides a training run.

- `cli`: `behemoth train | tune | eval | export | generate | check | check-cluster | check-nodes | spot-watch |
  data | report`: parses, loads the config, calls the API
- `cluster_check`: `behemoth check-cluster`: Ray's offline schema check + security lints
- `kuberay_check`: the same command on a KubeRay RayCluster or RayJob: KubeRay's CRD schema (vendored) + rules
- `data_bench`: `behemoth data bench`: the input pipeline alone, can the CPUs feed the GPUs
- `export`: `behemoth export`: a checkpoint as a Hugging Face folder with a model card
- `generate`: `behemoth generate`: a causal LM's completions (checkpoint or export; greedy or seeded sampling;
  chat template)
- `node_check`: `behemoth check-nodes`: a task pinned to each node checks the job's local paths
- `spot_watch`: `behemoth spot-watch`: on each spot node, the cloud's preemption notice (EC2 IMDSv2, GCE
  metadata) becomes a drain of the node through Ray
"""

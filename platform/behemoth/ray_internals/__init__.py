"""Every use of Ray's private APIs (`ray.*._internal`, `ray._private`, `ray._common`, Ray's generated
protobufs, private loggers and actor names) is imported here and nowhere else, so a Ray upgrade is read
against one folder: each module names the Ray version it was read against, and tests/unit/test_platform.py
fails when a file outside this folder imports a private Ray name or when the installed Ray is another version.

- `train_v2`: Ray Train V2's controller and context callbacks, its failure policy hook, placement-group cleaner,
  the variables it propagates to workers, its per-report logger.
- `data`: Ray Data's streaming executor (its scheduling loop is paced), its stats actor, the autoscaling
  coordinator's actor name, its progress logger.
- `torch_backend`: Ray Train's torch process-group set-up, called so that its controller does not import torch.
- `core`: Ray core's private state API, the node's log folder, its log-line hook, its token-auth logger, a node's
  drain for preemption (GCS's DrainNode), and
  the autoscaler's config checks.
"""

READ_AGAINST = "2.60.0"  # the Ray release every module here was read against (pyproject.toml pins 2.60.x)

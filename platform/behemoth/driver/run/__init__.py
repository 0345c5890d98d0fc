"""One run's sequence on the driver, from a checked job config to its summary.

- `sequence`: the run's steps whichever way it starts (resolve, check, prepare, launch, retire, summarise) and
  the one check of a job's data before Ray; a launcher per way a run starts, as hosts/ has a host per way a
  worker runs
- `trainer`: Ray Train's launcher (a TorchTrainer's fit) and `train`, the Python API's way in
- `evaluation`: `behemoth eval`: a checkpoint through the task's evaluation on Ray Train (the sequence's
  checks and preparation, then a TorchTrainer of the evaluation's workers)
- `preflight`: before Ray: model / tokenizer sources (offline found once), init_from, tracking packages, an
  epoch's steps, train.profile's window
- `resume`: before a (re)run: the run's place, resume checks, init_from; retention as Ray Train's config
- `summary`: RunSummary: what a finished run prints and the Python API returns
"""

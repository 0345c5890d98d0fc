"""One run's sequence on the driver, from a checked job config to its summary.

- `trainer`: config -> TorchTrainer -> fit -> summary; hands Ray Train the run's recorder
- `evaluation`: `behemoth eval`: a checkpoint through the task's evaluation on Ray Train
- `preflight`: before Ray: model / tokenizer sources (offline found once), init_from, tracking packages, an
  epoch's steps, train.profile's window
- `resume`: before a (re)run: the run's place, resume checks, init_from; after: retention
- `summary`: RunSummary: what a finished run prints and the Python API returns
"""

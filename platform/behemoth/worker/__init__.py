"""The worker's room: what every training worker runs (the loop and what it uses); no `ray` here: the host
(behemoth.hosts) is the worker's only way to Ray, and the checkpoints room's face (behemoth.checkpoints: save,
restore, latest, verify) its only way to checkpoints. Its modules (docs/architecture.md says more):

- `autobatch`: train.micro_batch_size auto: the largest micro-batch whose step fits
- `block_transforms`: the model's repeated blocks: activation checkpointing, torch.compile per block
- `checkpoint_interval`: when a checkpoint is due: every N steps, or auto (Young/Daly from the measured hold, or
  a hold budget kept as an account over the run), longer while a replica protects the run
- `ema`: train.ema_decay: the weights' moving average, updated on the device, kept as ema.pt
- `evaluate`: the task's validation metrics over the whole set; `behemoth eval`'s worker function
- `fault_hooks`: the failure tests' step hooks (slow step; kill or error after a report) as the loop's callback
- `feed`: the rank's steps epoch after epoch; the next epoch's pipeline opened early
- `ledger`: the sample ledger (train.sample_ledger)
- `loop`: train_loop_per_worker and the step, top to bottom (the file to read first)
- `memory_copies`: when a lone worker copies its state to the driver's memory (checkpoint.memory_copy), as a
  callback
- `optim`: optimizer and learning-rate schedule from `train`
- `parallel`: DDP / FSDP2 wrapping, FSDP's mixed precision, gradient compression hooks, buffers synced
- `plan`: micro-batch x accumulation x workers = the global batch
- `precision`: autocast, gradient scaler, fp32 master weights, a GPU's settings (TF32, cuDNN)
- `profiling`: train.profile: torch.profiler traces (and CUDA memory history) of a window of steps
- `reporting`: what a report step does (metrics, evaluation, checkpoint) and when
- `early_stopping`: train.early_stopping at an evaluation, and a resumed run's counts
- `report_sender`: ReportSender, a report handed to the host without holding the step
- `step_callbacks`: what runs around every step besides the update (EMA, ledger, memory copies, faults, profiler)
- `step_context`: what every step is taken with (config, task, trainables, rank, clock...), built once
- `speed`: the speed figures every report carries (TFLOP/s, MFU, memory)
"""

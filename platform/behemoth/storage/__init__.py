"""Where a run's bytes live, and in what form: the storage room.

- `filesystem`: the one answer to "local path or URI, and which pyarrow filesystem reads it".
- `store`: Store, the handle other rooms hold instead of asking that question: a place decided local-or-URI once,
  with verbs (read, write, append, list, copy a local folder up, a local copy or working folder).
- `run_store`: RunStore, where a run's checkpoints live, decided once: every checkpoint listed, written (in place,
  or staged and uploaded, the manifest last), claimed, opened and deleted through it (CheckpointWrite: one write);
- `paths`: a run's place (storage root, run folder, a sweep trial's folder), the run-name rules, and the one rule
  for a name that comes from data (a listing's key, a manifest's file): a relative path that stays inside its folder.
- `checkpoint`: the checkpoint format (state files, manifest of sizes and checksums written last, verify).
- `train_state`: TrainState, the loop's position that every checkpoint keeps (train_state.json).
- `shard_reader`: reading a sharded (DCP) checkpoint: only the byte ranges a load plan needs, checked.
- `dcp_index`: a sharded checkpoint's index read by a restricted unpickler and checked against its shards.
- `node_copy`: a checkpoint copied once per node for the ranks that read it.
- `model_copy`: a model's or tokenizer's folder in an object store copied once per node, named by its listing; any
  store folder's listing checked and copied file by file.
- `weights`: model weights in and out (a checkpoint's or a Hugging Face folder's).
- `runlock`: one driver per run folder, on local and object storage (the lease, its heartbeat and fence).
- `lease_stores`: where the lease lies and how it changes, conditionally (link/flock, S3 If-Match, read-back).

The checkpoints room (behemoth.checkpoints, above this one) takes a checkpoint and continues from one (live_state,
saver, sharded, restore: they need the model, the process group and the step), when the worker room says, through
a RunStore; everything here is what those bytes are and where they lie, and needs neither.
"""

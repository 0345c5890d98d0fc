"""Ray Data pipelines: the CPU side of a run, from the user's files to batches on the workers.

- `pipeline`: the settings every pipeline runs with; the input files a config's patterns name.
- images: `images` (an image folder's or shards' index and per-rank epoch datasets), `image_shards` (tar
  shards read safely), `decode` (decode and crop, the same pixels everywhere), `image_cache` (decode once per
  node into memory-mapped uint8 shards), `synth` (demo image folders).
- text: `text` (tokenise and pack a corpus into a token store), `token_store` (its shard files, memory-mapped
  and gathered by block index), `labelled_text` (text classification rows), `tokenizer` (a local BPE
  tokenizer), `synth_text` (a demo corpus).
- both: `order` (the global sample order, a function of seed and epoch), `prefetch` (batches copied to the
  device ahead of the step).
"""

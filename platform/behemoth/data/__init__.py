"""Ray Data pipelines: the CPU side of a run, from the user's files to batches on the workers. A folder per
workload, and what they share at the root.

- `image`: image classification's data (its config and index, decode and crop, a rank's batches, the decoded
  cache, tar shards, ImageNet's val split, mixup and cutmix, demo image folders).
- `text`: text's data (the causal LM's corpus read and tokenised, packed into the token store, labelled text for
  classification, a demo corpus).
- `chat`: conversations and DPO's preference pairs (rendered with the chat template in a bounded process, the
  assistant's tokens flagged, packed whole into the token store by text's packer; a model's pass over packed
  blocks for DPO's reference).
- shared: `pipeline` (the settings every Ray Data pipeline runs with; the input files a config's patterns name),
  `order` (the global sample order, a function of seed and epoch), `prefetch` (batches made ahead of the step;
  iterators opened ahead), `token_store` (packed token blocks in shard files, memory-mapped and gathered by block
  index: text's and chat's), `tokenizer` (a local BPE tokenizer).
"""

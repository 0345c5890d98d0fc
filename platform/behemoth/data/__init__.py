"""Ray Data pipelines: the CPU side of a run, from the user's files to batches on the workers.

- `pipeline`: the settings every pipeline runs with; the input files a config's patterns name.
- images: `images` (the image data config, and an image folder's, parquet set's or shards' index),
  `image_batches` (a rank's epoch of batches: samples read, decoded and augmented by Ray Data tasks),
  `image_shards` (tar shards read safely), `decode` (decode and crop, the same pixels everywhere),
  `image_cache` (the decoded cache's plan, key, check and memory-mapped uint8 rows), `image_cache_build` (that
  cache built once per node, under its lock), `synth` (demo image folders).
- text: `text` (the text data config; a corpus read, cut into work units and tokenised), `text_packing`
  (tokens packed into blocks in a token store, cached per corpus), `token_store` (its shard files,
  memory-mapped and gathered by block index), `labelled_text` (text classification rows), `tokenizer` (a local
  BPE tokenizer), `synth_text` (a demo corpus), `chat` (conversations rendered with the chat template, the
  assistant's tokens flagged: the config, the tokenizer and its template, a record read), `chat_sources` (its
  files cut into units, their first records checked before Ray), `chat_packing` (the tokenising tasks and the
  packer: whole conversations per document, into the token store), `chat_tokens` (a conversation's flagged tokens, its
  shape and cost bounded: the code the rendering process runs), `chat_render` (the template run in a child process
  bounded in time and memory; a record cut to what seq_len can use), `preference` (DPO's pairs: the data
  config and a record read as a pair), `pair_render` (a pair's two sequences, rendered in that process),
  `block_scores` (a model's pass over packed blocks in Ray Data actors: DPO's reference).
- images, more: `imagenet` (`behemoth data split-val`: ImageNet's flat val/ moved into class folders), `mixing`
  (mixup and cutmix of a training micro-batch on its device).
- both: `order` (the global sample order, a function of seed and epoch), `prefetch` (batches copied to the
  device ahead of the step).
"""

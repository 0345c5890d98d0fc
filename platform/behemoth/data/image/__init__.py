"""Image classification's data.

- `image_config`: the image job's `data:` section (ImageData).
- `images`: an image folder's, parquet set's or tar shards' index.
- `image_batches`: a rank's epoch of batches: samples read, decoded and augmented by Ray Data tasks.
- `decode`: decode and random-resized-crop at the per-core limit, the same pixels everywhere.
- `image_shards`: WebDataset tar shards read safely.
- `image_cache`: the decoded cache's plan, key, check and memory-mapped uint8 rows; `image_cache_build`: that
  cache built once per node, under its lock.
- `imagenet`: `behemoth data split-val`, ImageNet's flat val/ moved into class folders.
- `mixing`: mixup and cutmix of a training micro-batch, on its device.
- `synth`: demo image folders.
"""

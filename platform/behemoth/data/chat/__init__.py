"""Chat's data: conversations for fine-tuning, and DPO's preference pairs.

- `chat`: the chat data config, the tokenizer and its template, a record read.
- `chat_sources`: chat and preference files cut into units, their first records checked before Ray.
- `chat_packing`: the tokenising tasks and the packer: whole conversations per document, into the token store
  with text's packer.
- `chat_tokens`: a conversation's flagged tokens, its shape and cost bounded: the code the rendering process runs.
- `chat_render`: the template run in a child process bounded in time and memory; a record cut to what seq_len
  can use.
- `preference`: DPO's pairs: the data config and a record read as a pair; `pair_render`: a pair's two sequences,
  rendered in that process.
- `block_scores`: a model's pass over packed blocks in Ray Data actors (DPO's reference log-probabilities).
"""

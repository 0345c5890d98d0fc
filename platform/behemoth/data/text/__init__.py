"""Text's data.

- `text`: the text data config (TextData); a corpus read, cut into work units and tokenised.
- `text_packing`: tokens packed into blocks in the token store (data/token_store.py), cached per corpus; chat's
  packer (data/chat/chat_packing.py) plans and packs with it.
- `labelled_text`: (text, label) rows for sequence classification.
- `synth_text`: a demo corpus.
"""

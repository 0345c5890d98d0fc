"""Causal language models: any transformers AutoModelForCausalLM, from a config or from pretrained weights.

- `model.hf_config: {model_type: llama, hidden_size: 256, ...}` builds a fresh model with
  `AutoConfig.for_model` (tests and demos: tiny models, no download);
- `model.pretrained: PATH_OR_HUB_NAME` loads weights with `from_pretrained` (real fine-tuning runs); keys in
  `model.hf_config` then override the pretrained config (e.g. dropout).

The tokenizer decides the vocabulary: a fresh model gets the tokenizer's size and special-token ids; a
pretrained model whose embedding is smaller than the tokenizer is refused rather than silently resized.
"""

from __future__ import annotations

from behemoth.errors import ConfigError


def build_causal_lm(model_cfg, *, vocab_size: int, eos_id: int, bos_id: int | None, seq_len: int):
    """`model_cfg`: the job's behemoth.config.ModelConfig (not imported: models/ stands below config)."""
    from transformers import AutoModelForCausalLM

    if model_cfg.pretrained:
        overrides = {k: v for k, v in model_cfg.hf_config.items() if k != "model_type"}
        model = AutoModelForCausalLM.from_pretrained(model_cfg.pretrained,
                                                     trust_remote_code=model_cfg.trust_remote_code, **overrides)
        config = model.config
    else:
        config = causal_lm_config(model_cfg, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
        model = AutoModelForCausalLM.from_config(config)
    _check_fits(model_cfg, config, vocab_size, seq_len)
    return model


def causal_lm_config(model_cfg, *, vocab_size: int, eos_id: int, bos_id: int | None):
    """The transformers config the model is built from: model.pretrained's (its config.json alone, no weights),
    or a fresh one from model.hf_config with the tokenizer's size and special ids; hf_config's keys over it."""
    from transformers import AutoConfig

    overrides = dict(model_cfg.hf_config)
    model_type = overrides.pop("model_type", None)
    try:
        if model_cfg.pretrained:
            return AutoConfig.from_pretrained(model_cfg.pretrained, trust_remote_code=model_cfg.trust_remote_code,
                                              **overrides)
        overrides.setdefault("vocab_size", vocab_size)
        overrides.setdefault("eos_token_id", eos_id)
        overrides.setdefault("bos_token_id", bos_id if bos_id is not None else eos_id)
        return AutoConfig.for_model(model_type, **overrides)
    except config_errors() as e:  # an unknown model_type, a config.json that cannot be read, keys that disagree
        where = f"model.pretrained {model_cfg.pretrained}" if model_cfg.pretrained else "model.hf_config"
        raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None


def config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a model config it will not build: an unknown model_type or unreadable
    config.json (OSError, ValueError), and, for the configs it checks as strict dataclasses (Llama, Qwen, ...:
    `hidden_size` 64 with 5 attention heads), huggingface_hub's validation error, which is neither."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # (a huggingface_hub before strict dataclasses)
        return OSError, ValueError
    return OSError, ValueError, StrictDataclassError


def check_causal_lm(model_cfg, *, vocab_size: int, eos_id: int, bos_id: int | None, seq_len: int) -> None:
    """On the driver, before Ray: the model's config against the data (the tokenizer's vocabulary, data.seq_len),
    and model.lora's adapters against the model's modules, the model built on torch's meta device (no memory, no
    weights read), as the workers will build it."""
    config = causal_lm_config(model_cfg, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
    _check_fits(model_cfg, config, vocab_size, seq_len)
    if model_cfg.lora is None:
        return
    import torch
    from transformers import AutoModelForCausalLM

    from behemoth.models.lora import add_adapters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
        add_adapters(model, model_cfg.lora, "CAUSAL_LM")


def _check_fits(model_cfg, config, vocab_size: int, seq_len: int) -> None:
    where = model_cfg.pretrained or f"model.hf_config ({config.model_type})"
    if config.vocab_size < vocab_size:
        raise ConfigError(f"{where}: vocab_size {config.vocab_size} is smaller than the tokenizer's {vocab_size} "
                          f"tokens: use the model's own tokenizer, or a larger model.hf_config.vocab_size")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and max_positions < seq_len:
        raise ConfigError(f"{where}: max_position_embeddings {max_positions} < data.seq_len {seq_len}: lower "
                          f"data.seq_len or raise model.hf_config.max_position_embeddings")


# Model types whose every layer is plain causal self-attention through transformers' attention interface, and
# whose masks come from create_causal_mask (read in transformers 5's modeling files); where a config opens a
# sliding window or chunked attention, its own mask stays.
_FULL_CAUSAL = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_MASK_FREE = "behemoth_causal_sdpa"


def train_on_causal_attention(model):
    """Training on packed blocks (no padding, no cache): SDPA told `is_causal=True`, with no mask built.

    transformers builds the same kernel call itself, but decides so per forward by reading a tensor on the
    device (whether the position ids hold several packed sequences: `.all()` in find_packed_sequence_indices),
    which makes the host wait for the device once per micro-batch. An attention implementation registered
    under another name than those with a mask function makes transformers skip the mask entirely
    (masking_utils._preprocess_mask_arguments), and transformers' own sdpa_attention_forward then passes
    `is_causal=True`: the same kernel, the same numbers (tests/unit/test_host_sync.py), no wait. Only for the
    model types above with plain SDPA; anything else is left as it is. The worker's model only: an export
    builds its own."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    config = model.config
    windowed = any(getattr(config, key, None) for key in ("sliding_window", "attention_chunk_size"))
    layers = set(getattr(config, "layer_types", None) or ["full_attention"])
    if (config.model_type not in _FULL_CAUSAL or config._attn_implementation != "sdpa" or windowed
            or layers != {"full_attention"}):
        return model
    AttentionInterface.register(_MASK_FREE, sdpa_attention_forward)
    model.set_attn_implementation(_MASK_FREE)
    return model


def train_on_document_attention(model, device_type: str, chosen: bool):
    """Training on packed documents (data.document_mask, chat): on a GPU, FlexAttention with a block mask
    (tasks/causal_lm.document_inputs builds it from the documents' starts) instead of SDPA with a dense
    B x L x L mask, which makes SDPA leave its flash kernel and holds L x L booleans per sequence (64 M at
    8,192 tokens); the block mask is (L / 128)^2 blocks and the kernel skips the blocks no document spans
    (torchtitan's way). Where the model's config has plain SDPA and the job did not choose an implementation
    (`chosen`: model.hf_config names attn_implementation); elsewhere left as it is: on a CPU FlexAttention is
    compiled for each shape (a cost the small shapes there do not earn back), and flash attention takes the
    documents' cumulative lengths (document_inputs). Returns what it did, for the log (None: nothing)."""
    if chosen or device_type != "cuda" or model.config._attn_implementation != "sdpa":
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401  (torch >= 2.5)
    except ImportError:
        return None
    model.set_attn_implementation("flex_attention")
    return ("attention: FlexAttention with a block mask of the packed documents (instead of SDPA with a dense "
            "L x L mask; model.hf_config.attn_implementation: sdpa keeps that)")


# A reply the chat template renders verbatim: what follows it in the rendering is the template's end of a turn.
_PROBE_REPLY = "behemoth probe reply"


def end_of_turn_id(tok, render) -> int | None:
    """The token a chat template closes an assistant's turn with (ChatML's <|im_end|>, Llama 3's <|eot_id|>,
    Gemma's <end_of_turn>), where it is one added token of the vocabulary: read from the template's own
    rendering of a two-turn conversation, the first token after the reply, not from a list of known names.
    None without a template, or where the template writes no added token there. `render(tok, conversation)`
    renders it (data/chat/chat.py's render_text: bounded, in a process of its own), raising ValueError where the
    template cannot."""
    if not getattr(tok, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
    try:
        text = render(tok, conversation)
    except ValueError:  # a template that wants another shape of conversation, or breaks a bound
        return None
    _, found, after = str(text).rpartition(_PROBE_REPLY)
    ids = tok(after, add_special_tokens=False)["input_ids"] if found else []
    return ids[0] if ids and ids[0] in tok.added_tokens_decoder else None


def generation_config(tok, render, base=None):
    """transformers' GenerationConfig for a causal LM with tokenizer `tok`: `base`'s settings (a pretrained
    model's own sampling defaults stay), the stop ids extended by the tokenizer's EOS and the chat template's
    end-of-turn token (a chat reply ends there, not at EOS; `render`: end_of_turn_id's), a pad id (the
    tokenizer's, else EOS: generate needs one and would otherwise say so on every call)."""
    import copy

    from transformers import GenerationConfig

    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    kept = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = [i for i in dict.fromkeys([*kept, tok.eos_token_id, end_of_turn_id(tok, render)]) if i is not None]
    config.eos_token_id = stops if len(stops) > 1 else stops[0]
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if config.bos_token_id is None:
        config.bos_token_id = tok.bos_token_id
    return config

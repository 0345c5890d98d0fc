"""What `model.hf_config` may hold: architecture keys only (sizes, layers, dropout, ...), never a loading option.

transformers' `from_pretrained(path, **kwargs)` takes its own options out of kwargs (where the weights come
from, how they are unpickled, which kernels run, which remote code runs) and sets the rest on the model's
config: those are the architecture keys. behemoth passes hf_config as those kwargs, so a loading option there
would change how a model loads without the job saying so: `weights_only: false` unpickles the weights file
(running any code in it), `use_kernels` / `kernel_config` fetch and run kernels from the Hub,
`trust_remote_code` runs the repository's Python code. Each is refused by name, with its reason.

The names are transformers' own: the parameters of `PreTrainedModel.from_pretrained` and the kwargs it, the
Auto classes' `from_pretrained` and `PreTrainedConfig`'s loading pop (tests/unit/test_models.py reads them from
the installed transformers and checks this table names every one). No transformers import here: the config is
checked on the driver before any model code is imported.
"""

from __future__ import annotations

from behemoth.errors import ConfigError

_RUNS_CODE = "runs code that is not behemoth's"
_SOURCE = "chooses where the weights and config are downloaded from"
_PLACEMENT = "decides how the weights are placed, cast or sharded (behemoth's train and scaling sections do)"
_INTERNAL = "is an internal or obsolete from_pretrained argument"

# option -> why it is not an architecture key
LOADING_OPTIONS: dict[str, str] = {
    "weights_only": "decides whether the weights file is unpickled, which runs any code inside it (behemoth "
                    "loads with weights_only=True only)",
    "trust_remote_code": "runs the repository's own Python code: set model.trust_remote_code: true if you mean it",
    "code_revision": f"picks the revision of a repository's code to run ({_RUNS_CODE})",
    "use_kernels": f"fetches compiled kernels from the Hugging Face Hub and runs them ({_RUNS_CODE})",
    "kernel_config": f"fetches compiled kernels from the Hugging Face Hub and runs them ({_RUNS_CODE})",
    "allow_all_kernels": f"lets unverified Hub repositories' kernels run ({_RUNS_CODE})",
    "state_dict": "replaces the weights being loaded",
    "adapter_kwargs": "loads a PEFT adapter from another repository",
    "adapter_name": "loads a PEFT adapter from another repository",
    "key_mapping": "renames the weights being loaded",
    "gguf_file": "loads the weights from a GGUF file instead",
    "use_safetensors": "chooses which weights file format is read (behemoth reads safetensors or weights_only)",
    "variant": "chooses which weights file is read",
    "config": "replaces the whole config (give its keys in hf_config instead)",
    "ignore_mismatched_sizes": "decides which weights may be dropped (behemoth decides: the image head only)",
    "cache_dir": _SOURCE, "force_download": _SOURCE, "local_files_only": _SOURCE, "token": _SOURCE,
    "revision": _SOURCE, "proxies": _SOURCE, "subfolder": _SOURCE, "mirror": _SOURCE,
    "dtype": _PLACEMENT, "torch_dtype": _PLACEMENT, "device_map": _PLACEMENT, "max_memory": _PLACEMENT,
    "offload_folder": _PLACEMENT, "offload_buffers": _PLACEMENT, "offload_state_dict": _PLACEMENT,
    "quantization_config": _PLACEMENT, "distributed_config": _PLACEMENT, "device_mesh": _PLACEMENT,
    "tp_plan": _PLACEMENT, "tp_size": _PLACEMENT, "fusion_config": _PLACEMENT, "disable_mmap": _PLACEMENT,
    "low_cpu_mem_usage": _PLACEMENT, "generation_config": "replaces the generation config being loaded",
    "output_loading_info": _INTERNAL, "tqdm_class": _INTERNAL, "from_tf": _INTERNAL, "from_flax": _INTERNAL,
    "_from_pipeline": _INTERNAL, "_from_auto": _INTERNAL, "_fast_init": _INTERNAL, "_commit_hash": _INTERNAL,
    "_configuration_file": _INTERNAL, "return_unused_kwargs": _INTERNAL,
}

# Config attributes that choose which code runs: only transformers' built-in implementations (a Hub repository,
# "org/name", would be downloaded and run; transformers takes the private spellings, _attn_implementation, too).
BUILT_IN_IMPLEMENTATIONS = {
    "attn_implementation": ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4",
                            "flex_attention"),
    "experts_implementation": ("eager", "batched_mm", "grouped_mm", "deepgemm", "sonicmoe"),
}
KERNEL_NAMING_KEYS = tuple(BUILT_IN_IMPLEMENTATIONS)
# A sub-model's config inside a composite one (text_config, vision_config, ...) is checked key by key too.
_MAX_DEPTH = 4


def check_hf_config(hf_config: dict, where: str = "model.hf_config", depth: int = 0) -> None:
    """Refuse anything in model.hf_config but architecture keys, naming it and why: an allow-list of what a
    key may be. Its name: public (a `_private` key is transformers' own state, e.g. `_attn_implementation`,
    which it honours as an option too), not a loading option; its value: plain data (numbers, strings, lists,
    nested configs checked the same way); an implementation choice only among transformers' built-in ones."""
    if depth > _MAX_DEPTH:
        raise ConfigError(f"{where} nests configs {depth} deep: more than any transformers model has")
    for key, value in hf_config.items():
        name = f"{where}.{key}"
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{where}: {key!r} is not an architecture key (a config attribute's name)")
        if key.startswith("_"):
            raise ConfigError(f"{name} is a private attribute of transformers' config, not an architecture key: "
                              f"transformers reads some as loading options (_attn_implementation picks a kernel). "
                              f"Remove it from hf_config")
        if key in LOADING_OPTIONS:
            raise ConfigError(f"{name} is a loading option of from_pretrained, not an architecture "
                              f"key: it {LOADING_OPTIONS[key]}. Remove it from hf_config")
        if key in BUILT_IN_IMPLEMENTATIONS and value is not None:
            allowed = BUILT_IN_IMPLEMENTATIONS[key]
            if isinstance(value, str) and "/" in value:
                raise ConfigError(f"{name} {value!r} names a Hugging Face Hub repository whose kernel "
                                  f"transformers would download and run ({_RUNS_CODE}): use a built-in "
                                  f"implementation ({', '.join(allowed)})")
            if value not in allowed:
                raise ConfigError(f"{name} {value!r} is not one of transformers' built-in implementations "
                                  f"({', '.join(allowed)})")
        _check_value(value, name, depth)


def _check_value(value, name: str, depth: int) -> None:
    if isinstance(value, dict):
        check_hf_config(value, name, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_value(item, f"{name}[{i}]", depth + 1)
    elif not (value is None or isinstance(value, (bool, int, float, str))):
        raise ConfigError(f"{name} is a {type(value).__name__}: an architecture key holds plain data")

"""Where a model's (or a tokenizer's) files come from, checked before Ray starts: a local folder that exists, or a
Hugging Face Hub name that is well formed and either in this machine's Hugging Face cache or reachable.

Offline (HF_HUB_OFFLINE=1, or the Hub not answering one TCP connection within a few seconds), a name the cache
does not hold is one error naming the key and what to do, found in seconds: transformers alone would retry for
half a minute, on the driver and again on every worker, before its own error. Once the Hub is found unreachable,
this process says so to transformers and huggingface_hub (HF_HUB_OFFLINE) so that nothing retries.
"""

from __future__ import annotations

import os
import re
import socket
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from behemoth.errors import ConfigError

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_local(value: str) -> bool:
    """A path the user means as a folder on this machine (not a Hub name): absolute, ~, ./ or ../, or existing."""
    return value.startswith(("/", "~", "./", "../")) or os.path.exists(os.path.expanduser(value))


def check_source(value: str, key: str, needs: str = "config.json") -> None:
    """`value` (the config's `key`): a local folder holding `needs`, or a Hub name this machine can get."""
    if "://" in value:
        return  # a URI: read where it is (checkpoints), or a path transformers does not take (its own error)
    if looks_local(value):
        folder = Path(value).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"{key} {value}: no such folder on this machine. A local model is a folder that "
                              f"from_pretrained reads (config.json, weights, tokenizer files), on every node that "
                              f"trains; or give a Hugging Face Hub name (org/name)")
        if needs and not (folder / needs).is_file():
            raise ConfigError(f"{key} {value}: the folder has no {needs}: it is not a Hugging Face model folder "
                              f"(save_pretrained's, or `huggingface-cli download NAME --local-dir {value}`)")
        return
    if not _HUB_NAME.match(value) or ".." in value or "--" in value:
        raise ConfigError(f"{key} {value!r} is neither a folder on this machine nor a Hugging Face Hub name "
                          f"(org/name): check its spelling")
    told = _offline_by_env()  # (before the probe, which sets it for this process)
    if _in_cache(value, needs) or hub_reachable():
        return
    raise ConfigError(f"{key} {value}: not in this machine's Hugging Face cache and the Hub is unreachable "
                      f"({'HF_HUB_OFFLINE=1' if told else 'no answer from it'}). Download it where there is "
                      f"network (huggingface-cli download {value} --local-dir DIR), copy DIR to every node, and "
                      f"set {key} to DIR")


def _in_cache(name: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(name, filename or "config.json")
    return isinstance(found, str)


def _offline_by_env() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


@lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face Hub (HF_ENDPOINT) answers a TCP connection, asked once per process; when it does
    not, HF_HUB_OFFLINE=1 is set for this process (transformers and huggingface_hub then do not retry)."""
    if _offline_by_env():
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        return False

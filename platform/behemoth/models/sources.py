"""Where a model's (or a tokenizer's) files come from, checked before Ray starts: a local folder that exists, or a
Hugging Face Hub name that is well formed and either in this machine's Hugging Face cache or reachable.

Offline (HF_HUB_OFFLINE=1, or the Hub not answering one HEAD request within a few seconds), a name the cache does
not hold is one error naming the key and what to do, found in seconds: transformers alone would retry for half a
minute, on the driver and again on every worker, before its own error. The request goes through huggingface_hub's
own HTTP client, so it takes the way every download will (HF_ENDPOINT, HTTPS_PROXY/HTTP_PROXY, NO_PROXY). Once the
Hub is found unreachable, this process says so where transformers and huggingface_hub read it (their constant,
read once at import, and HF_HUB_OFFLINE for the processes started from here) so that nothing retries.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from behemoth.errors import ConfigError

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_local(value: str) -> bool:
    """A path the user means as a folder on this machine (not a Hub name): absolute, ~, ./ or ../, or existing."""
    return value.startswith(("/", "~", "./", "../")) or os.path.exists(os.path.expanduser(value))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def holds_tokenizer(folder: str) -> bool:
    """Whether a local model folder holds a tokenizer's files (what AutoTokenizer.from_pretrained reads)."""
    return any((Path(folder).expanduser() / name).is_file() for name in TOKENIZER_FILES)


def check_source(value: str, key: str, needs: str = "config.json") -> None:
    """`value` (the config's `key`): a local folder holding `needs` (a tokenizer: one of TOKENIZER_FILES), or a
    Hub name this machine can get. (An object store's folder is checked by driver/run/preflight.py, which reads its
    listing.)"""
    if looks_local(value):
        _check_folder(Path(value).expanduser(), value, key, needs)
        return
    if not _HUB_NAME.match(value) or ".." in value or "--" in value:
        raise ConfigError(f"{key} {value!r} is neither a folder on this machine nor a Hugging Face Hub name "
                          f"(org/name): check its spelling")
    endpoint = hub_endpoint()  # (a malformed HF_ENDPOINT: one line, before huggingface_hub trips on it)
    told = offline_by_setting()  # (before the probe, which turns offline mode on for this process)
    if _in_cache(value, needs or "tokenizer_config.json") or hub_reachable():
        return
    raise ConfigError(f"{key} {value}: not in this machine's Hugging Face cache and the Hub is unreachable "
                      f"({'HF_HUB_OFFLINE=1' if told else 'no answer from ' + endpoint}). Download it where there "
                      f"is network (hf download {value} --local-dir DIR), copy DIR to every node, and set {key} to DIR")


def _check_folder(folder: Path, value: str, key: str, needs: str) -> None:
    if not folder.is_dir():
        raise ConfigError(f"{key} {value}: no such folder on this machine. A local model is a folder that "
                          f"from_pretrained reads (config.json, weights, tokenizer files), on every node that "
                          f"trains; or give a Hugging Face Hub name (org/name)")
    if needs and not (folder / needs).is_file():
        raise ConfigError(f"{key} {value}: the folder has no {needs}: it is not a Hugging Face model folder "
                          f"(save_pretrained's, or `hf download NAME --local-dir {value}`)")
    if not needs and not holds_tokenizer(str(folder)):
        raise ConfigError(f"{key} {value}: the folder holds no tokenizer ({', '.join(TOKENIZER_FILES)}): point "
                          f"{key} at a tokenizer's folder (the model's own, or `behemoth data train-tokenizer`'s)")


def _in_cache(name: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    found = try_to_load_from_cache(name, filename)
    return isinstance(found, str)


def offline_by_setting() -> bool:
    """Whether huggingface_hub is in offline mode: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as it read them when
    imported, or as this process set it since (hub_reachable)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_endpoint() -> str:
    """The Hub's address as huggingface_hub uses it (HF_ENDPOINT as it read it when imported), checked: a URL that
    cannot be parsed is one line naming HF_ENDPOINT, not a traceback from inside the client (huggingface_hub
    parses it when its download module is imported: a job that never names the Hub fails on it too)."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    try:
        parsed = urlparse(endpoint)
        parsed.port  # noqa: B018 - raises ValueError for a port out of range
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("not an http(s):// address")
    except ValueError as e:
        raise ConfigError(f"HF_ENDPOINT {endpoint!r} is not a valid Hub address ({e}): fix it (e.g. "
                          f"https://huggingface.co or a mirror's https://HOST) or unset it") from None
    return endpoint


@lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a HEAD request through huggingface_hub's own HTTP session (its
    endpoint, the proxies of the environment), asked once per process; when it does not, offline mode is turned
    on for this process and those it starts (nothing retries)."""
    if offline_by_setting():
        return False
    endpoint = hub_endpoint()
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=timeout_s)  # any HTTP answer: the Hub (or a mirror) is there
        return True
    except Exception:  # noqa: BLE001 - any failure of the client (connection, proxy, TLS, timeout): not reachable
        set_offline()
        return False


def set_offline() -> None:
    """Offline mode where huggingface_hub and transformers read it (constants.HF_HUB_OFFLINE: every
    is_offline_mode()), and in the environment handed to the processes started from here."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"


def model_file(source: str, name: str) -> Path | None:
    """The file `name` of a model's top-level files (a local folder, or a Hub name: from this machine's Hugging Face
    cache, else downloaded where the Hub answers), or None where the model has none or cannot be reached here (the
    source's own check says which, before Ray: check_source)."""
    if looks_local(source):
        found = Path(source).expanduser() / name
        return found if found.is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        if _in_cache(source, name) or hub_reachable():
            return Path(hf_hub_download(source, name))
    except Exception:  # noqa: BLE001 - no such file or repository, a malformed name, the Hub failing: none here
        pass
    return None

"""Loading a job config: YAML -> `--set a.b=c` overrides -> typed objects (config/schema.py), and back to YAML.

Errors name the file, the key and what to do: an unknown key also names the closest valid key, a wrong type
names the expected type (`one of ['none', 'full'] or int`, not `Union`).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from behemoth.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from behemoth.config.schema import JobConfig, ModelConfig


class _JobLoader(yaml.SafeLoader):
    """PyYAML's safe loader with two of YAML 1.2's rules: `3e-4` is a number (YAML 1.1, which PyYAML follows,
    wants `3.0e-4` and reads `3e-4` as text, so `lr: 3e-4`, as the docs and every paper write it, was refused as
    a string), and a key given twice in one mapping is an error (1.1 keeps the last silently: a second `lr:` or
    a second `train:` section pasted at the end replaced the first without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (`<<: *defaults`: merged by the base class)
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice in one mapping (first on line {seen[key] + 1}): keep "
                    f"one", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_JobLoader.add_implicit_resolver(  # (YAML 1.2's float: an exponent without a point, e.g. 3e-4, 1E5)
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_yaml(text: str):
    """A YAML document as behemoth reads every config, sweep and `--set` value (_JobLoader's rules)."""
    return yaml.load(text, Loader=_JobLoader)  # noqa: S506 - a SafeLoader subclass: no arbitrary objects


def read_yaml_mapping(path: str | Path, what: str = "config file", holds: str = "sections (data, model, "
                      "train, ...)") -> dict:
    """The mapping a YAML file holds; a missing file, text that is not UTF-8, invalid YAML or another shape is a
    ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} does not exist")
    try:
        raw = load_yaml(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): save it "
                          f"as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {' '.join(str(e).split())}") from None
    if raw is None:  # (every default is no job: the first missing key's message hid that the file is empty)
        raise ConfigError(f"{p} is empty: it must hold a mapping of {holds}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{p} must hold a mapping of {holds}")
    return raw


def warn_remote_code(model: ModelConfig) -> None:
    """The one line that says whose code will run when a job trusts a repository's code (printed where the
    job is loaded on the driver: once per run, not once per worker)."""
    if model.trust_remote_code:
        print(f"[behemoth] warning: model.trust_remote_code is true: the Python code of repository "
              f"{model.pretrained} will run wherever the model is built (every worker, behemoth export)",
              file=sys.stderr, flush=True)


def apply_override(raw: dict, item: str) -> None:
    """Set `raw[a][b] = value` for a `--set a.b=value` item (the value read as YAML)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=0.05")
    dotted, value = item.split("=", 1)
    keys = dotted.strip().split(".")
    node = raw
    for k in keys[:-1]:
        if node.get(k) is None or node.get(k) is False:  # (absent, empty `eval:`, or an optional section off)
            node[k] = {}
        node = node[k]
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section (it holds {node!r})")
    try:
        node[keys[-1]] = load_yaml(value) if value != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML ({' '.join(str(e).split())})") from None


def from_dict(cls: type, raw: Any, where: str, prefix: str = "", scope: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types recursively; `scope` says which of several
    classes a section was read into (an unknown key's message names it)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the file'} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            hint = did_you_mean(key, names, prefix) or f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"{where}: unknown key '{prefix}{key}'{scope}{hint}")
    kwargs = {k: _coerce(hints[k], v, where, f"{prefix}{k}") for k, v in raw.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str, key: str) -> Any:
    if dataclasses.is_dataclass(tp):  # a section that is always there: an empty one (`train:`) is its defaults
        return from_dict(tp, {} if value is None else value, where, prefix=key + ".")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        section = next((a for a in args if dataclasses.is_dataclass(a)), None)
        if section is not None:
            return _optional_section(section, value, where, key)
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, where, key)
            except ConfigError:
                continue
        raise _type_error(where, key, tp, value)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {key} must be one of {list(args)}, got {value!r}"
                              f"{did_you_mean(value, list(args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(where, key, tp, value)
        return {str(k): _coerce(args[1], v, where, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(where, key, tp, value)
        return [_coerce(args[0], v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    if tp is Any:
        return value
    raise _type_error(where, key, tp, value)


def _optional_section(section: type, value: Any, where: str, key: str) -> Any:
    """An optional section (model.lora, train.early_stopping, train.profile, ...): off for null or false, on for
    a mapping (`{}`: on with its defaults). Anything else is refused, `true` included: which settings it would
    turn on is not said, and a section on by mistake (LoRA freezing the base model) trains something else."""
    if value is None or value is False:
        return None
    if isinstance(value, dict):  # its own errors, key by key
        return from_dict(section, value, where, prefix=key + ".")
    raise ConfigError(f"{where}: {key} is a section: give a mapping to turn it on ({{}} for its defaults) or "
                      f"null/false for off, got {type(value).__name__} {value!r}")


def _type_error(where: str, key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{where}: {key} expects {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _type_name(tp: Any) -> str:
    """A type as a config's reader says it: `one of ['none', 'full'] or int`, not `Union`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) if a is not type(None) else "null" for a in args)
    if origin is Literal:
        return f"one of {list(args)}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def dump_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

"""Reading a DeepSpeed JSON config strictly: errors carry ``file:line:column``; duplicate keys
and NaN/Infinity are refused. ``ConfigError`` is every config error of ``zeropp.config``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any, NoReturn


class ConfigError(ValueError):
    """A config problem, described in one line that names the key path and the value."""


def read_json_config(path_or_dict: str | PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Return the config as a fresh dict: a mapping is deep-copied, a path is parsed strictly.

    Parse errors carry ``file:line:column``; duplicate keys and NaN/Infinity are rejected
    because Python's json module would otherwise accept them silently.
    """
    if isinstance(path_or_dict, Mapping):
        return copy.deepcopy(dict(path_or_dict))
    if not isinstance(path_or_dict, (str, PathLike)):
        raise ConfigError(f"config: expected a file path or a dict, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if not path.is_file():
        if path.exists():
            raise ConfigError(f"{path}: not a regular file, expected a DeepSpeed JSON config")
        raise FileNotFoundError(f"DeepSpeed config file not found: {path}")

    def reject_constant(name: str) -> NoReturn:
        raise ConfigError(f"{path}: {name} is not valid JSON; write a finite number")

    def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:  # json would keep the last one and hide the conflict
                raise ConfigError(f"{path}: duplicate key '{key}' in one JSON object")
            seen.add(key)
        return dict(pairs)

    try:
        text = path.read_text(encoding="utf-8")
        loaded = json.loads(text, object_pairs_hook=reject_duplicates, parse_constant=reject_constant)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}:{error.colno}: {error.msg}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object, got {type(loaded).__name__}")
    return loaded

"""Value checks: each takes (key path, raw value) and returns the normalized value or raises
``ConfigError`` naming the path; and the filling of a parameter block from its table.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from zeropp.config.json_reading import ConfigError

# Value checks: each takes (key path, raw value) and returns the normalized value or raises.
Check = Callable[[str, Any], Any]


def _show(value: Any) -> str:
    """Render a value as JSON, so messages quote what the user wrote."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _fail(path: str, expected: str, value: Any) -> NoReturn:
    if isinstance(value, str) and value.strip().lower() == "auto":
        raise ConfigError(f'{path}: "auto" is a Hugging Face Trainer placeholder; resolve it to '
                          f"{expected} first: zeropp.config.resolve_auto does, and "
                          "zeropp.initialize calls it once the model is known")
    raise ConfigError(f"{path}: expected {expected}, got {_show(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(minimum: int, expected: str) -> Check:
    def check(path: str, value: Any) -> int:
        # JSON writers (and people) write 5e8 for 500000000: integral floats are integers.
        integral = _is_number(value) and math.isfinite(value) and float(value).is_integer()
        if not integral or int(value) < minimum:
            _fail(path, expected, value)
        return int(value)

    return check


def _real(minimum: float, inclusive: bool, expected: str, maximum: float = math.inf) -> Check:
    def check(path: str, value: Any) -> float:
        valid = _is_number(value) and math.isfinite(value) and minimum <= value <= maximum
        if not valid or (not inclusive and value == minimum):
            _fail(path, expected, value)
        return float(value)

    return check


_positive_int = _integer(1, "a positive integer")
_non_negative_int = _integer(0, "a non-negative integer")
_positive_float = _real(0.0, False, "a positive number")
_non_negative_float = _real(0.0, True, "a non-negative number")
_unit_interval = _real(0.0, True, "a number in [0, 1]", maximum=1.0)


def _boolean(path: str, value: Any) -> bool:
    # "true" strings and 0/1 are rejected: a quoted flag is usually a templating mistake.
    if not isinstance(value, bool):
        _fail(path, "true or false", value)
    return value


def _optional(check: Check) -> Check:
    return lambda path, value: None if value is None else check(path, value)


def _one_of(*choices: Any) -> Check:
    """Exact choices; strings match case-insensitively and normalize to the listed spelling."""
    expected = "one of " + ", ".join(_show(choice) for choice in choices)

    def check(path: str, value: Any) -> Any:
        for choice in choices:
            if isinstance(choice, str) and isinstance(value, str) and value.lower() == choice.lower():
                return choice
            if _is_number(choice) and _is_number(value) and value == choice:
                return choice
        _fail(path, expected, value)

    return check


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str):
        _fail(path, "a string", value)
    return value


def _string_list(path: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        _fail(path, "an array of strings", value)
    return list(value)


def _devices(path: str, value: Any) -> Any:
    # CUDA_VISIBLE_DEVICES written into the JSON: a device index, a "0,1" string or a list.
    def index(item: Any) -> bool:
        return isinstance(item, int) and not isinstance(item, bool) and item >= 0

    valid = (isinstance(value, str) or index(value)
             or (isinstance(value, list) and all(map(index, value))))
    if not valid:
        _fail(path, "a device index, a string or an array of indices", value)
    return value


def _object(path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        _fail(path, "an object", value)
    return dict(value)


def _unknown_key(path: str, candidates: set[str]) -> NoReturn:
    key = path.rpartition(".")[2]
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"{path}: unknown key{hint}")


_REQUIRED = object()  # marks a parameter without a default


def _fill_params(path: str, raw: Any, table: Mapping[str, tuple[Check, Any]]) -> dict[str, Any]:
    """Check the given parameters and fill the missing ones with DeepSpeed's defaults."""
    given = _object(path, raw)
    for key in given.keys() - table.keys():
        _unknown_key(f"{path}.{key}", set(table))
    params = {}
    for key, (check, default) in table.items():
        if key in given:
            params[key] = check(f"{path}.{key}", given[key])
        elif default is _REQUIRED:
            raise ConfigError(f"{path}.{key}: required for this type and missing")
        else:
            params[key] = copy.deepcopy(default)
    return params

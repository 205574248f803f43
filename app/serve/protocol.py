"""What both APIs of `llmlocal serve` share in reading a request and answering an error: the
JSON error (`APIError`), refusing the fields llmlocal does not implement by name, reading numbers
and stop strings, and the finish reasons. The server (`serve`) and the routes of each API
(`openai_api`, `ollama_api`) import it; it imports neither."""

from __future__ import annotations

import math
from typing import Any

FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


class APIError(Exception):
    """An error answered as JSON: OpenAI's {"error": {message, type, param, code}}, or on
    Ollama's routes its {"error": message}."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = status, message, code, kind, param

    def body(self, ollama: bool = False) -> dict[str, Any]:
        if ollama:
            return {"error": self.message}
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refuse_unknown(fields: dict[str, Any], known: set[str], neutral: dict[str, tuple[Any, ...]], what: str = "field") -> None:
    """A 400 naming every field outside ``known`` whose value asks for something (null, and
    the values in ``neutral``, ask for nothing)."""
    def asks_nothing(key: str, value: Any) -> bool:
        return value is None or any(type(value) is type(n) and value == n for n in neutral.get(key, ()))

    bad = sorted(k for k, v in fields.items() if k not in known and not asks_nothing(k, v))
    if bad:
        names = ", ".join(f"'{k}'" for k in bad)
        raise APIError(400, f"llmlocal does not implement the {what}{'s' if len(bad) > 1 else ''} {names}: "
                       f"remove {'them' if len(bad) > 1 else 'it'} from the request.", "unsupported_parameter", param=bad[0])


def number(fields: dict[str, Any], key: str, default: Any, kind: type = float, label: str | None = None) -> Any:
    """``fields[key]`` as a ``kind`` (absent or null: ``default``), else a 400 naming it."""
    value = fields.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (kind is int and value != int(value)):
        raise APIError(400, f"'{label or key}' must be {'an integer' if kind is int else 'a number'}.", param=key)
    return kind(value)


def stop_strings(value: Any, label: str = "stop") -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise APIError(400, f"'{label}' must be a string or a list of strings.", param=label)
    return tuple(value)

"""The user's settings: one TOML file that supplies what the command line leaves open.

    $LLMLOCAL_CONFIG, else $XDG_CONFIG_HOME/llmlocal/config.toml (~/.config/llmlocal/config.toml)

    model = "bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M"
    ctx = 4096
    temperature = 0.3

    [system_prompts]
    terse = "Answer in one sentence."

Every key is optional. A setting comes from the first of: a command-line flag, an environment
variable (``LLMLOCAL_MODELS_DIR``, ``LLMLOCAL_DATA_DIR``), this file, the built-in default.
The file is read with tomllib and checked whole: an unknown key or a value of the wrong type
is a `ConfigError` naming the file and the fix. `save` rewrites it whole (a temporary file,
then a rename), keys in a fixed order; comments are not kept.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmlocal.models.errors import LLMLocalError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "LLMLOCAL_CONFIG"
BACKENDS = ("auto", "llamacpp", "paged", "sparse")
PRESETS = "system_prompts"  # the one table: named system prompts
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class ConfigError(LLMLocalError):
    """The config file cannot be read or holds a bad key or value; the message says the fix."""


@dataclass(frozen=True)
class Key:
    """One setting: its TOML type, the values it accepts, and what applies when it is unset."""

    name: str
    kind: type  # str, int, float, or Path (a string in the file)
    rule: str  # the accepted values, in words: "a whole number >= 16"
    builtin: str  # what applies when the key is unset, in words
    example: str  # a value for the `config set` example
    ok: Callable[[Any], bool] = field(default=lambda v: True)
    env: str | None = None  # the environment variable that overrides the file


_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[?[0-9A-Fa-f:.]+\]?")
_ORIGIN = re.compile(r"\*|https?://[^/\s,]+")


def _listed(value: str, item: re.Pattern[str]) -> bool:
    """Whether ``value`` is one or more comma-separated items, each matching ``item``."""
    parts = [p.strip() for p in value.split(",")]
    return all(item.fullmatch(p) for p in parts)


KEYS: dict[str, Key] = {
    k.name: k
    for k in (
        Key("model", str, "a model name from `llmlocal models list` or a path to a .gguf file",
            "smollm2-135m, the bundled starter", "org/repo:Q4_K_M", lambda v: bool(v.strip())),
        Key("backend", str, f"one of {', '.join(BACKENDS)}", "auto", "llamacpp", lambda v: v in BACKENDS),
        Key("ctx", int, "a whole number of tokens, at least 16", "the model's context, up to 8192", "4096",
            lambda v: v >= 16),
        Key("threads", int, "a whole number, at least 1", "the physical cores", "4", lambda v: v >= 1),
        Key("temperature", float, "a number >= 0 (0 is greedy)", "0.8", "0.3", lambda v: v >= 0),
        Key("top_p", float, "a number in (0, 1]", "0.95", "0.9", lambda v: 0 < v <= 1),
        Key("top_k", int, "a whole number >= 0 (0 disables it)", "40", "40", lambda v: v >= 0),
        Key("min_p", float, "a number in [0, 1)", "0.05", "0.05", lambda v: 0 <= v < 1),
        Key("repeat_penalty", float, "a number > 0 (1 disables it)", "1.0", "1.1", lambda v: v > 0),
        Key("max_tokens", int, "a whole number, at least 1", "until the model stops or the context is full",
            "512", lambda v: v >= 1),
        Key("seed", int, "a whole number", "a new random seed each run", "42"),
        Key("models_dir", Path, "an absolute path", "$XDG_DATA_HOME/llmlocal/models", "~/models",
            lambda v: v.expanduser().is_absolute(), env="LLMLOCAL_MODELS_DIR"),
        Key("data_dir", Path, "an absolute path", "$XDG_DATA_HOME/llmlocal", "~/llmlocal-data",
            lambda v: v.expanduser().is_absolute(), env="LLMLOCAL_DATA_DIR"),
        # `serve`: who may call it (see `serve --help`); several values are separated by commas
        Key("allow_host", str, "host names or addresses separated by commas, without ports", "none: localhost only",
            "mybox.lan", lambda v: _listed(v, _HOST)),
        Key("cors_origin", str, "origins like http://localhost:3000 separated by commas, or *", "none: local pages only",
            "https://app.example.com", lambda v: _listed(v, _ORIGIN)),
        Key("max_connections", int, "a whole number, at least 1", "64", "64", lambda v: v >= 1),
        Key("kv_cache_dir", Path, "an absolute path", "$XDG_CACHE_HOME/llmlocal/kv", "~/.cache/llmlocal/kv",
            lambda v: v.expanduser().is_absolute(), env="LLMLOCAL_KV_CACHE_DIR"),
        Key("kv_cache_size", str, "a size such as 4G or 512M, or off", "4G", "8G", lambda v: kv_cache_bytes(v) is not False),
        Key("packed_cache_dir", Path, "an absolute path", "$XDG_CACHE_HOME/llmlocal/packed", "~/.cache/llmlocal/packed",
            lambda v: v.expanduser().is_absolute(), env="LLMLOCAL_PACKED_CACHE_DIR"),
        Key("packed_cache_size", str, "a size such as 16G or 4G, or off", "16G", "8G", lambda v: kv_cache_bytes(v) is not False),
    )
}


def kv_cache_bytes(text: str) -> int | None | bool:
    """A kv_cache_size (or packed_cache_size) setting in bytes; None for "off"; False if it is neither."""
    if text.strip().lower() in ("off", "0", "none", "no"):
        return None
    from llmlocal.engine.planning.hardware import parse_size
    from llmlocal.models.errors import LLMLocalError

    try:
        return parse_size(text)
    except LLMLocalError:
        return False


@dataclass(frozen=True)
class Config:
    """The file's settings, checked: only keys of `KEYS`, each of its type."""

    path: Path
    values: Mapping[str, Any] = field(default_factory=dict)
    system_prompts: Mapping[str, str] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def system_prompt(self, name: str) -> str:
        if name in self.system_prompts:
            return self.system_prompts[name]
        have = ", ".join(self.system_prompts) or "none yet"
        raise ConfigError(
            f"No system prompt preset '{name}' in {self.path} (presets: {have}): add it with "
            f"`llmlocal config set {PRESETS}.{name} \"TEXT\"`."
        )


def config_path() -> Path:
    """Where the file is: $LLMLOCAL_CONFIG, else the platform's config directory."""
    override = os.environ.get(CONFIG_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("APPDATA") or str(Path.home() / "AppData" / "Roaming")
        return Path(base) / "llmlocal" / "config.toml"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "llmlocal" / "config.toml"


# ---- reading ----------------------------------------------------------------------------
def load(path: Path | None = None) -> Config:
    """The settings in ``path`` (default: `config_path()`); no file means no settings."""
    path = path or config_path()
    return checked(read_raw(path), path)


def read_raw(path: Path) -> dict[str, Any]:
    """The file as TOML, unchecked ({} when it does not exist)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text: save it as UTF-8, or delete it to start again.") from None
    except OSError as e:
        raise ConfigError(f"Cannot read {path} ({e.strerror}): fix its permissions, or point {CONFIG_ENV} elsewhere.") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML ({e}): fix that line, or delete the file to start again.") from None


def checked(raw: Mapping[str, Any], path: Path) -> Config:
    """``raw`` as a `Config`; the first unknown key or bad value raises `ConfigError`."""
    values: dict[str, Any] = {}
    prompts: dict[str, str] = {}
    for name, value in raw.items():
        if name == PRESETS:
            prompts = _checked_presets(value, path)
        elif name in KEYS:
            values[name] = _checked_value(KEYS[name], value, path)
        else:
            raise ConfigError(
                f"Unknown key '{name}' in {path}: remove that line, or run `llmlocal config unset {name}` "
                f"(known keys: {', '.join(KEYS)}, and the [{PRESETS}] table)."
            )
    return Config(path, values, prompts)


def _checked_value(key: Key, value: Any, path: Path) -> Any:
    typed = _typed(key, value)
    if typed is None or not key.ok(typed):
        raise ConfigError(
            f"{key.name} in {path} must be {key.rule}, not {value!r}: change it with "
            f"`llmlocal config set {key.name} {key.example}`, or remove that line."
        )
    return typed


def _typed(key: Key, value: Any) -> Any:
    """``value`` as the key's type, or None when it is not one (a bool is not a number)."""
    if isinstance(value, bool):
        return None
    if key.kind is int:
        return value if isinstance(value, int) else None
    if key.kind is float:
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
    if key.kind is Path:
        return Path(value) if isinstance(value, str) and value else None
    return value if isinstance(value, str) else None


def _checked_presets(table: Any, path: Path) -> dict[str, str]:
    if not isinstance(table, dict):
        raise ConfigError(f"{PRESETS} in {path} must be a table of name = \"text\": write it as [{PRESETS}].")
    for name, text in table.items():
        if not isinstance(text, str):
            raise ConfigError(
                f"The preset {PRESETS}.{name} in {path} must be a string, not {text!r}: "
                f"change it with `llmlocal config set {PRESETS}.{name} \"TEXT\"`."
            )
    return dict(table)


# ---- changing -------------------------------------------------------------------------
def parse_setting(name: str, text: str) -> tuple[str, Any]:
    """`config set NAME TEXT` as (key, typed value); ``system_prompts.NAME`` sets a preset."""
    if name.startswith(f"{PRESETS}."):
        preset = name.split(".", 1)[1]
        if not _BARE_KEY.match(preset):
            raise ConfigError(f"A preset name uses letters, digits, '-' and '_' only, not '{preset}': choose another.")
        return name, text
    key = KEYS.get(name)
    if key is None:
        raise ConfigError(f"Unknown key '{name}': use one of {', '.join(KEYS)}, or {PRESETS}.NAME for a system prompt preset.")
    value = _parse_text(key, text)
    if isinstance(value, Path):
        value = value.expanduser().absolute()  # a relative path means the directory it was typed in
    if value is None or not key.ok(value):
        raise ConfigError(f"{name} must be {key.rule}, not '{text}': e.g. `llmlocal config set {name} {key.example}`.")
    if name == "model":
        value = canonical_model(value)
    return name, value


def _parse_text(key: Key, text: str) -> Any:
    try:
        if key.kind is int:
            return int(text)
        if key.kind is float:
            value = float(text)
            return value if math.isfinite(value) else None
    except ValueError:
        return None
    if key.kind is Path:
        return Path(text) if text else None
    return text


def canonical_model(name: str) -> str:
    """The form of a model name to store: an existing path made absolute, else the name the
    model resolves to (``org/repo:q4_k_m`` -> ``org/repo:Q4_K_M``). A name that does not
    resolve raises the resolver's one-sentence error."""
    from llmlocal.models import resolve

    resolved = resolve(name)
    path = Path(name).expanduser()
    if path.exists():
        return str(path.absolute())  # not resolved: a symlink the user keeps pointing elsewhere stays one
    return resolved.name


def set_value(name: str, text: str, path: Path | None = None) -> Config:
    """Check ``text`` for the setting ``name`` and write it, keeping the file's other keys."""
    path = path or config_path()
    key, value = parse_setting(name, text)
    raw = read_raw(path)
    if key.startswith(f"{PRESETS}."):
        prompts = raw.get(PRESETS) if isinstance(raw.get(PRESETS), dict) else {}
        raw[PRESETS] = {**prompts, key.split(".", 1)[1]: value}
    else:
        raw[key] = str(value) if isinstance(value, Path) else value
    config = checked(raw, path)  # another bad key stops the write: the file stays as it was
    save(config)
    return config


def unset_value(name: str, path: Path | None = None) -> bool:
    """Remove the setting ``name`` (any key, known or not); False when it was not there."""
    path = path or config_path()
    raw = read_raw(path)
    if name.startswith(f"{PRESETS}.") and isinstance(raw.get(PRESETS), dict):
        found = raw[PRESETS].pop(name.split(".", 1)[1], None) is not None
        if not raw[PRESETS]:
            del raw[PRESETS]
    else:
        found = raw.pop(name, None) is not None
    if found:
        save(checked(raw, path))
    return found


def save(config: Config) -> None:
    """Write ``config`` to its file atomically: a temporary file beside it, then a rename."""
    target = config.path.resolve()  # through a symlink (dotfile managers): replace the file it names
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o644
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(dumps(config))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise ConfigError(f"Cannot write {target} ({e.strerror}): fix the directory's permissions, or point {CONFIG_ENV} elsewhere.") from None


# The file holds strings, whole numbers, finite floats and one table of strings: these few
# lines write exactly that TOML, so no writer library is needed (tests read it back with tomllib).
def dumps(config: Config) -> str:
    lines = ["# llmlocal settings: `llmlocal config list` shows them, `llmlocal config set KEY VALUE` changes one."]
    for name in KEYS:
        if name in config.values:
            lines.append(f"{name} = {_toml_value(config.values[name])}")
    if config.system_prompts:
        lines += ["", f"[{PRESETS}]"]
        lines += [f"{_toml_key(n)} = {_toml_string(t)}" for n, t in config.system_prompts.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, (int, float)):
        return repr(value)  # a finite float's repr is a TOML float: 0.3, 1e-05, 1e+20
    return _toml_string(str(value))


def _toml_key(name: str) -> str:
    return name if _BARE_KEY.match(name) else _toml_string(name)


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# ---- what applies ---------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    key: str
    value: Any  # None: unset, the built-in default applies (`Key.builtin` says what it is)
    source: str  # "$LLMLOCAL_MODELS_DIR", "config file" or "built-in"


def effective(config: Config, name: str) -> Setting:
    """What a command uses for ``name`` when no flag sets it: environment > file > built-in."""
    key = KEYS[name]
    if key.env and os.environ.get(key.env):
        return Setting(name, Path(os.environ[key.env]).expanduser(), f"${key.env}")
    if name in config.values:
        value = config.values[name]
        return Setting(name, value.expanduser() if isinstance(value, Path) else value, "config file")
    return Setting(name, _builtin_value(name), "built-in")


def _builtin_value(name: str) -> Any:
    """The built-in defaults that are one value; None for those that depend on the model or machine."""
    if name == "model":
        from llmlocal.models.resolve import DEFAULT_MODEL

        return DEFAULT_MODEL
    if name == "models_dir":
        from llmlocal.models.store import models_dir

        return models_dir()  # LLMLOCAL_MODELS_DIR is unset here: this is the platform default
    if name == "data_dir":
        from .history import data_dir

        return data_dir()
    if name == "kv_cache_dir":
        from llmlocal.engine.core.kv_disk import default_dir

        return default_dir()
    if name == "packed_cache_dir":
        from llmlocal.native.cpu.packed_cache import default_dir as packed_default

        return packed_default()
    if name == "backend":
        return "auto"
    return None


def apply_paths(config: Config) -> None:
    """Hand the file's directories to the model store and the chat database, which read
    LLMLOCAL_MODELS_DIR and LLMLOCAL_DATA_DIR (they sit below app/ and know nothing of this
    file): each is set only where the variable is not, so an exported one still wins, and
    child processes see the same directories."""
    for key in KEYS.values():
        if key.env and key.name in config.values and not os.environ.get(key.env):
            os.environ[key.env] = str(config.values[key.name].expanduser())

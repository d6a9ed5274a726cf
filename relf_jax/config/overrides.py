"""Building a `Config` in layers: defaults, a named preset, then ``key=value`` overrides, each
checked against the schema (an unknown key or a value of the wrong type is a `ConfigError`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

from relf_jax.config.presets import ALIASES, PRESETS
from relf_jax.config.schema import Config, ConfigError, coerce


def make_config(preset: str = "cpu", overrides: Optional[list[str] | dict[str, Any]] = None,
                **kwargs: Any) -> Config:
    """Build a validated `Config` from a preset name and overrides.

    `overrides` is a list of ``"key=value"`` strings (values parsed by the field's type) or a
    dict of already-typed values; keyword arguments are further overrides with ``__`` for dots
    (``train__steps=10``).
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    values: dict[str, Any] = dict(PRESETS[preset])
    if isinstance(overrides, dict):
        values.update(overrides)
    else:
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form key=value")
            key, raw = item.split("=", 1)
            values[key.strip()] = raw
    for key, v in kwargs.items():
        values[key.replace("__", ".")] = v
    cfg = Config(preset=preset)
    for key, v in values.items():
        cfg = set_value(cfg, key, v)
    return cfg.validate()


def set_value(cfg: Config, key: str, value: Any) -> Config:
    """Return `cfg` with the dotted `key` set to `value` (a string is parsed by the field type)."""
    key = ALIASES.get(key, key)
    parts = key.split(".")
    return _set(cfg, parts, value, prefix="")


def _set(obj: Any, parts: list[str], value: Any, prefix: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = parts[0]
    full = prefix + name
    if name not in fields:
        choices = ", ".join(prefix + f for f in fields)
        raise ConfigError(f"unknown config key {full!r}; valid keys here: {choices}")
    hints = typing.get_type_hints(type(obj))
    ftype = hints[name]
    if len(parts) > 1:
        sub = getattr(obj, name)
        if not dataclasses.is_dataclass(sub):
            raise ConfigError(f"config key {full!r} has no sub-keys")
        return dataclasses.replace(obj, **{name: _set(sub, parts[1:], value, full + ".")})
    if dataclasses.is_dataclass(ftype):
        subs = ", ".join(f"{full}.{f.name}" for f in dataclasses.fields(ftype))
        raise ConfigError(f"config key {full!r} is a group; set one of: {subs}")
    return dataclasses.replace(obj, **{name: coerce(full, ftype, value)})

"""Typed errors shared by every process. Each carries the values involved."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ConfigError", "ProtocolError"]


# Settings with a flag and no environment variable: the config file's own path is a flag only.
_FLAG_ONLY = frozenset({"config"})


class ConfigError(ValueError):
    """A setting has a value it may not have. Names the setting and what is allowed."""

    def __init__(self, setting: str, value: object, allowed: str) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        names = "--" + setting.replace("_", "-")
        if setting not in _FLAG_ONLY:
            names += f", KVSWITCH_{setting.upper()}"
        super().__init__(f"invalid {setting} ({names}) = {value!r}: {allowed}")

    @classmethod
    def one_of(cls, setting: str, value: object, choices: Iterable[str]) -> ConfigError:
        return cls(setting, value, "allowed values: " + ", ".join(choices))


class ProtocolError(ValueError):
    """Bytes that do not decode to the message the subject promises."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"malformed {what}: {detail}")

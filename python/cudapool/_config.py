"""Configuration text: keyword options and CUDAPOOL_CONF, merged and checked in one place.

The syntax is PYTORCH_CUDA_ALLOC_CONF's: "key:value,key:value". The C parser
(``_C.parse_config``) is the only judge of what is valid; this module turns keyword options
into that text, splits CUDAPOOL_CONF into its entries so that keyword options can replace
them key by key, and, when the text is invalid, finds the entry to blame so that the
ValueError names it.
"""

import os
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, NamedTuple, Optional

from . import _C, policies

#: The environment variable ``cudapool.enable()`` reads its configuration from.
ENV_VAR = "CUDAPOOL_CONF"

_FROM_KWARGS = "keyword argument"


class Entry(NamedTuple):
    """One configuration entry: ``key``, the value as the user gave it, its "key:value"
    text, and where it came from (a keyword argument or CUDAPOOL_CONF)."""

    key: str
    value: Any
    text: str
    source: str


def format_value(value: Any) -> str:
    """A keyword option's value as configuration text.

    bool values become True/False; a mapping {size_mb: n, ">": n} becomes the bracketed
    list form of roundup_power2_divisions ("[64:8,>:4]"); anything else is str(value).
    """
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, Mapping):
        return "[" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "]"
    return str(value)


def _top_level_pieces(text: str) -> List[str]:
    """``text`` cut at every ',' outside brackets ("[256:1,>:4]" stays whole), unstripped."""
    pieces = []
    depth = 0
    current: List[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]" and depth > 0:
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append("".join(current))
            current = []
            continue
        current.append(ch)
    pieces.append("".join(current))
    return pieces


def split_entries(text: str) -> List[str]:
    """The comma-separated entries of a configuration string, stripped, empty ones dropped.
    Commas inside brackets ("[256:1,>:4]") do not separate entries."""
    return [e.strip() for e in _top_level_pieces(text) if e.strip()]


def entries_from_text(text: str, source: str = ENV_VAR) -> "OrderedDict[str, Entry]":
    """The entries of a "key:value,..." string by key; a later entry of a key replaces an
    earlier one. An entry without a colon keeps its whole text as the key (and is invalid)."""
    out: "OrderedDict[str, Entry]" = OrderedDict()
    for item in split_entries(text):
        key, sep, value = item.partition(":")
        key = key.strip()
        value_text = value.strip() if sep else None
        entry_text = f"{key}:{value_text}" if sep else item
        out.pop(key, None)
        out[key] = Entry(key, value_text, entry_text, source)
    return out


def _has_top_level_comma(text: str) -> bool:
    """Whether ``text`` has a ',' outside brackets: where the parser starts a new entry."""
    return len(_top_level_pieces(text)) > 1


def entries_from_mapping(config: Mapping[str, Any]) -> "OrderedDict[str, Entry]":
    """The entries of keyword options, in their order.

    A keyword option is one entry: a key or value whose text holds a ',' outside brackets
    would smuggle further entries into the configuration, so it is a ValueError."""
    out: "OrderedDict[str, Entry]" = OrderedDict()
    for key, value in config.items():
        text = f"{key}:{format_value(value)}"
        if _has_top_level_comma(text):
            raise ValueError(
                f"invalid config option {key!r} = {value!r}: one keyword is one key:value entry; "
                "a ',' outside [...] would start another (pass each key as its own keyword)"
            )
        out[key] = Entry(key, value, text, _FROM_KWARGS)
    return out


def merge(env_text: Optional[str], config: Mapping[str, Any], use_policy: bool = False) -> "OrderedDict[str, Entry]":
    """CUDAPOOL_CONF's entries with the keyword options on top: a keyword option replaces
    the environment's entry of the same key.

    With ``use_policy``, a named policy's configuration goes underneath both: the one named
    by a ``policy`` entry (keyword first, then CUDAPOOL_CONF), else the default policy."""
    env = entries_from_text(env_text or "", ENV_VAR)
    kwargs = entries_from_mapping(config)
    merged: "OrderedDict[str, Entry]" = OrderedDict()
    if use_policy:
        chosen = kwargs.pop("policy", None) or env.pop("policy", None)
        name = str(chosen.value) if chosen is not None else policies.DEFAULT_POLICY
        try:
            base = policies.config_for(name)
        except ValueError as exc:
            where = "" if chosen is None or chosen.source == _FROM_KWARGS else f" (from {chosen.source})"
            raise ValueError(f"invalid config option 'policy' = {name!r}{where}: {exc}") from None
        merged.update(entries_from_text(base, f"policy {name}"))
    for entries in (env, kwargs):
        for key, entry in entries.items():
            merged[key] = entry  # a later source wins: replaces in place, or appends
    return merged


def _reason(exc: ValueError) -> str:
    """The parser's message without its "CUDAPOOL_CONF: " lead: the caller names the source."""
    message = str(exc)
    lead = f"{ENV_VAR}: "
    return message[len(lead) :] if message.startswith(lead) else message


def check(entries: Mapping[str, Entry]) -> str:
    """The "key:value,..." text of the entries, after checking it as a whole.

    When it is invalid, the ValueError names the first entry that is invalid on its own
    (an unknown key, a bad value), with its source; when every entry is valid alone, the
    combination is at fault and the message says why.
    """
    text = ",".join(entry.text for entry in entries.values())
    try:
        _C.parse_config(text)
    except ValueError as whole:
        for entry in entries.values():
            try:
                _C.parse_config(entry.text)
            except ValueError as exc:
                where = "" if entry.source == _FROM_KWARGS else f" (from {entry.source})"
                raise ValueError(
                    f"invalid config option {entry.key!r} = {entry.value!r}{where}: {_reason(exc)}"
                ) from None
        raise ValueError(f"invalid configuration {text!r}: {_reason(whole)}") from None
    return text


def config_string(config: Mapping[str, Any]) -> str:
    """The checked "key:value,..." text of keyword options (see :func:`check`)."""
    return check(entries_from_mapping(config))


def resolve(config: Mapping[str, Any], env: Optional[Dict[str, str]] = None, use_policy: bool = False) -> str:
    """The checked text of CUDAPOOL_CONF (from ``env``, default os.environ) with the keyword
    options on top, over a named policy's configuration when ``use_policy``."""
    environ = os.environ if env is None else env
    return check(merge(environ.get(ENV_VAR), config, use_policy))


def effective(text: str) -> str:
    """The complete configuration (defaults filled in) that ``text`` selects, formatted the
    same way whatever the order or spelling of the entries."""
    return _C.parse_config(text)

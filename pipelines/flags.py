"""How a setting of the configuration tree is spelled on `loom serve`'s command line.

A field of pipelines/config.py carries a `Flag` in its annotation
(`max_batch_size: Annotated[int, Flag("...", names=("--max-batch-size", "--max-num-seqs"))]`):
its spellings, help and parser are written once, beside the field and its default, and the
command line is generated from them (`add_flags`). A field without one is resolved by the CLI
(a GGUF file's tokenizer directory) or has no flag yet.
"""

from __future__ import annotations

import argparse
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

import msgspec


@dataclass(frozen=True)
class Flag:
    help: str
    # Every spelling, MAX's first where it has one; (): "--" and the field's name.
    names: tuple[str, ...] = ()
    negations: tuple[str, ...] = ()  # flags that set a boolean setting to False
    parse: Callable[[str], Any] | None = None  # text -> value; default: the field's type
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    # Given several times: a list of the values (the CLI splits them, one tree each).
    repeatable: bool = False
    multiple: bool = False  # several values (`--lora-paths a=x b=y`, or the flag repeated)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'2GiB', '512MB', '1.5g' or a plain number of bytes."""
    match = _SIZE.match(text)
    if not match or (match.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (try 2GiB or 512MB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def parse_names(text: str) -> tuple[str, ...]:
    """A comma-separated list."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def parse_true_false(text: str) -> bool:
    if text not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"not true or false: {text!r}")
    return text == "true"


def setting_fields(struct_type: type) -> typing.Iterator[tuple[str, type, Any, Flag | None]]:
    """(name, type, default, flag) of every setting (leaf field) of a tree of Structs."""
    for _, *setting in _owned_settings(struct_type):
        yield tuple(setting)


def _owned_settings(struct_type: type) -> typing.Iterator[tuple]:
    """(the Struct holding it, name, type, default, flag) of every setting of the tree."""
    hints = typing.get_type_hints(struct_type, include_extras=True)
    for field in msgspec.structs.fields(struct_type):
        hint = hints[field.name]
        base, flag = hint, None
        if typing.get_origin(hint) is typing.Annotated:
            base, *extras = typing.get_args(hint)
            flag = next((x for x in extras if isinstance(x, Flag)), None)
        if isinstance(base, type) and issubclass(base, msgspec.Struct):
            yield from _owned_settings(base)
        else:
            yield struct_type, field.name, base, field.default, flag


def group_flags(struct_type: type) -> typing.Iterator[tuple[type, str, Flag]]:
    """(the group's Struct, its name, its flag) of each group with a flag of its own: one
    argument for several of its settings (vLLM's --speculative-config JSON), parsed into
    {setting name: value}."""
    hints = typing.get_type_hints(struct_type, include_extras=True)
    for field in msgspec.structs.fields(struct_type):
        base, extras = hints[field.name], ()
        if typing.get_origin(base) is typing.Annotated:
            base, *extras = typing.get_args(base)
        if isinstance(base, type) and issubclass(base, msgspec.Struct):
            flag = next((x for x in extras if isinstance(x, Flag)), None)
            if flag is not None:
                yield base, field.name, flag
            yield from group_flags(base)


def expand_group_flags(settings: dict) -> dict:
    """The settings of the flags given, a group flag's spread out; a setting's own flag wins
    over a group flag's value for it."""
    expanded = {}
    for name, value in settings.items():
        if isinstance(value, dict):
            expanded = {**value, **expanded}
        else:
            expanded[name] = value
    return expanded


def flag_names(name: str, flag: Flag) -> tuple[str, ...]:
    return flag.names or ("--" + name.replace("_", "-"),)


def add_flags(parser: argparse.ArgumentParser, struct_type: type) -> None:
    """One argument per flagged setting of the tree, every spelling landing on the setting's
    name, listed under its group's name (MAX's `KVCacheConfig`, ...). Nothing is filled in for
    a flag not given (the tree's defaults stand), so the parsed namespace holds exactly the
    settings the user chose."""
    groups = {}  # (each Struct of the tree: its section of --help)
    for owner, name, base, default, flag in _owned_settings(struct_type):
        if flag is None:
            continue
        if owner not in groups:
            groups[owner] = parser.add_argument_group(owner.__name__)
        _add_flag(groups[owner], name, base, default, flag)
    for group, name, flag in group_flags(struct_type):
        groups.get(group, parser).add_argument(
            *flag_names(name, flag), dest=name, default=argparse.SUPPRESS, help=flag.help,
            type=flag.parse, metavar=flag.metavar)


def _add_flag(parser, name: str, base: Any, default: Any, flag: Flag) -> None:
    shown = "" if default in (None, "", ()) else f" (default: {_shown(default)})"
    kwargs = dict(dest=name, default=argparse.SUPPRESS, help=flag.help + shown)
    if _value_type(base) is bool and flag.parse is None:
        parser.add_argument(*flag_names(name, flag), action="store_const", const=True,
                            **kwargs)
        if flag.negations:
            parser.add_argument(*flag.negations, action="store_const", const=False,
                                dest=name, default=argparse.SUPPRESS,
                                help=f"sets {flag_names(name, flag)[0]} off")
        return
    if flag.repeatable:
        kwargs["action"] = "append"
    value_type = _value_type(base)
    metavar = flag.metavar or ("SIZE" if flag.parse is parse_size
                              else {int: "N", float: "X"}.get(value_type))
    if flag.multiple:
        kwargs.update(nargs="+", action="extend")
        value_type = str
    parser.add_argument(*flag_names(name, flag), type=flag.parse or value_type,
                        choices=flag.choices, metavar=metavar, **kwargs)


def _value_type(base: Any) -> type:
    """int for `int | None`."""
    if isinstance(base, types.UnionType) or typing.get_origin(base) is typing.Union:
        return next(t for t in typing.get_args(base) if t is not type(None))
    return base


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(getattr(default, "value", default))

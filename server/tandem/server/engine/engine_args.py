"""CLI flags for every ``EngineConfig`` field, derived from the dataclass so names never drift.

``--block-size`` is ``EngineConfig.block_size`` is the CRD's ``spec.engine.blockSize``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from .config import EngineConfig

_SKIP = {"model"}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None
            )
        elif _is_tuple(hint):  # a list of strings: --lora-modules a=x b=y
            group.add_argument(flag, dest=f.name, nargs="+", default=None)
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=_scalar_type(hint),
                default=None,
                choices=typing.get_args(hint)
                if typing.get_origin(hint) is typing.Literal
                else None,
            )


def _is_tuple(hint: object) -> bool:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return typing.get_origin(hint) is tuple or any(typing.get_origin(a) is tuple for a in args)


def _scalar_type(hint: object) -> type:
    if typing.get_origin(hint) is typing.Literal:
        return str
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float, str) else str


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Only flags the user gave override the dataclass defaults."""
    given = {
        f.name: _field_value(getattr(args, f.name))
        for f in dataclasses.fields(EngineConfig)
        if f.name not in _SKIP and getattr(args, f.name, None) is not None
    }
    return EngineConfig(model=model, **given)


def _field_value(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value

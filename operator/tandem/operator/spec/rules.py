"""How a spec model validates: camelCase fields and rules stated once for CEL and Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class Rule:
    """One validation rule, stated twice in one place: CEL for the API server, Python for us.

    ``cel`` becomes an ``x-kubernetes-validations`` entry on the model's schema; ``check``
    runs in the model's validator. Both report ``message``, so users see the same words
    from ``kubectl apply`` and from ``tandem up``. ``field`` points the CEL error at a field
    (``fieldPath``) when the rule is about one.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    field: str | None = None


class SpecModel(BaseModel):
    """camelCase in YAML, snake_case in Python; unknown fields are errors, not silently dropped."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> SpecModel:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

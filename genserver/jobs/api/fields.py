"""Strict request fields: a JSON value of the wrong type is a 400, never coerced (one place for every body).

DRF's own fields convert: a CharField turns the number 12345 into the text
"12345", an IntegerField takes `true` as 1. A client that sends the wrong type
has a bug; the API names it instead of guessing what was meant.
"""

from __future__ import annotations

import math
from typing import Any

from rest_framework import serializers

NOT_A_STRING = "Must be a string (in double quotes), not {kind}."
NOT_A_NUMBER = "Must be a number, not a boolean."


def json_kind(value: Any) -> str:
    """How a client would name the JSON type of a parsed value ("a number", "a boolean", "an array"…)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if value is None:
        return "null"
    return type(value).__name__


class StrictStringMixin:
    """Refuses any JSON value that is not a string, before the field's own checks."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            raise serializers.ValidationError(NOT_A_STRING.format(kind=json_kind(data)), code="not_a_string")
        return super().to_internal_value(data)  # type: ignore[misc]


class StrictCharField(StrictStringMixin, serializers.CharField):
    """A CharField that takes only JSON strings."""


class StrictRegexField(StrictStringMixin, serializers.RegexField):
    """A RegexField that takes only JSON strings."""


class StrictURLField(StrictStringMixin, serializers.URLField):
    """A URLField that takes only JSON strings."""


class StrictChoiceField(StrictStringMixin, serializers.ChoiceField):
    """A ChoiceField of strings that takes only JSON strings."""


class StrictIntegerField(serializers.IntegerField):
    """An integer given as a JSON number or digit string; booleans are refused."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool):
            raise serializers.ValidationError(NOT_A_NUMBER, code="not_a_number")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A float that must be finite: booleans, NaN and ±inf are refused, not stored."""

    default_error_messages = {"not_finite": "A finite number is required (not NaN or infinity)."}

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            raise serializers.ValidationError(NOT_A_NUMBER, code="not_a_number")
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            self.fail("not_finite")
        return value

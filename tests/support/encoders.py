"""Counting a family's text-encoder calls, for the tests of what batches prompts together."""

from __future__ import annotations


def encoder_calls(monkeypatch, family_class: type) -> list[int]:
    """Wrap `family_class.encode`: each call appends how many prompts it took to the returned list."""
    calls: list[int] = []
    encode = family_class.encode

    def counting(self, prompts):
        calls.append(len(prompts))
        return encode(self, prompts)

    monkeypatch.setattr(family_class, "encode", counting)
    return calls

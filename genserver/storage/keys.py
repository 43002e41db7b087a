"""Storage keys both sides compute: the API (an embedding-cache hit at submit) and the model runtime."""

from __future__ import annotations

import hashlib
import re


def encoder_identity(family: str, model: str) -> str:
    """Names a model's text encoder, so cached embeddings are shared only where valid."""
    return f"{family}:{model}"


def embeddings_key(encoder: str, prompt: str, negative: str) -> str:
    """Where the embeddings of (prompt, negative prompt) under `encoder` (`encoder_identity`) are stored."""
    digest = hashlib.sha256(f"{encoder}\0{prompt}\0{negative}".encode()).hexdigest()
    return f"embeddings/{digest}.pt"


_EMBEDDINGS_KEY = re.compile(r"embeddings/[0-9a-f]{64}\.pt")


def names_its_content(key: str) -> bool:
    """Whether `key` is an `embeddings_key`: named by what it holds, so what is stored under it never changes (a
    worker may keep it in memory)."""
    return _EMBEDDINGS_KEY.fullmatch(key) is not None

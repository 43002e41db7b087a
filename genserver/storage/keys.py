"""Storage keys both sides compute: the API (an embedding-cache hit at submit) and the model runtime."""

from __future__ import annotations

import hashlib


def encoder_identity(family: str, model: str) -> str:
    """Names a model's text encoder, so cached embeddings are shared only where valid."""
    return f"{family}:{model}"


def embeddings_key(encoder: str, prompt: str, negative: str) -> str:
    """Where the embeddings of (prompt, negative prompt) under `encoder` (`encoder_identity`) are stored."""
    digest = hashlib.sha256(f"{encoder}\0{prompt}\0{negative}".encode()).hexdigest()
    return f"embeddings/{digest}.pt"

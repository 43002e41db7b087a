"""Where a new job's first stage is: the encode worker, or its first denoise chunk straight away.

A leaf (it imports no other part of the service), so submission and the fair window's release share it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from genserver.registry import ModelSpec
from genserver.storage import StorageError, default_storage, keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FirstStage:
    """`embeddings_key` "": the job goes through the encode worker. Else its first chunk is published at once
    with that key: the embeddings are `stored` (a hit), or the model encodes on its card (`encode_on_card`)
    and the chunk's card encodes and stores them before its first step."""

    embeddings_key: str = ""
    stored: bool = False


def first_stage(spec: ModelSpec, prompt: str, negative: str) -> FirstStage:
    """Whether a job of these prompts skips the encode hop. A storage error on the lookup reads as "not stored":
    the encode worker (or the card) encodes them again."""
    key = keys.embeddings_key(keys.encoder_identity(spec.family, spec.name), prompt, negative)
    try:
        stored = default_storage().exists(key)
    except StorageError:
        log.warning("could not look up cached embeddings %s; they are encoded again", key, exc_info=True)
        stored = False
    if stored or spec.encode_on_card:
        return FirstStage(key, stored)
    return FirstStage()

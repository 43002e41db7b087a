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
    with that key: the embeddings are `stored` (a hit, counted at submit), or the model encodes on its card
    (`encode_on_card`: not looked up here; the chunk's card reads them, or encodes and stores them, and counts)."""

    embeddings_key: str = ""
    stored: bool = False


def first_stage(spec: ModelSpec, prompt: str, negative: str) -> FirstStage:
    """Whether a job of these prompts skips the encode hop. A model that encodes on its card always does, with no
    lookup here (on an object store a HEAD on every submit's path): its card reads the key and encodes only when it
    finds nothing, and counts the lookup. A storage error on the lookup reads as "not stored": the encode worker
    encodes them again."""
    key = keys.embeddings_key(keys.encoder_identity(spec.family, spec.name), prompt, negative)
    if spec.encode_on_card:
        return FirstStage(key, stored=False)
    try:
        stored = default_storage().exists(key)
    except StorageError:
        log.warning("could not look up cached embeddings %s; they are encoded again", key, exc_info=True)
        stored = False
    return FirstStage(key, stored) if stored else FirstStage()

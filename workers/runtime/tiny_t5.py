"""The tiny T5-family text encoders of the tiny checkpoints (FLUX's T5 v1.1, Wan's UMT5) and their tokenizer.

One vocabulary layout and one encoder config; each checkpoint passes its own words and relative-position
buckets. The tokenizer is transformers' T5Tokenizer (a tokenizers Unigram model, the class both FLUX's
`tokenizer_2` and Wan's `tokenizer` load as) over a vocabulary written here: the special tokens in T5's
order, "▁", the printable ASCII characters alone and word-initial ("▁x"), and a few whole words (more
likely, so the Unigram prefers them over characters). Anything else becomes <unk>, as with the real
vocabulary. No SentencePiece model file is needed; tokenizer.json is written by save_pretrained.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import T5Tokenizer

T5_MAX_TOKENS = 512  # FLUX.1-dev's max_sequence_length and Wan's text length (the cost model counts 512)


def tiny_t5_vocab(words: Sequence[str]) -> list[tuple[str, float]]:
    """(piece, log-probability) in T5's order: <pad>=0, </s>=1, <unk>=2, then the pieces. A one-letter word
    is already its character's word-initial piece, so only longer words are added."""
    chars = [c for c in string.printable if not c.isspace()]
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -6.0) for c in chars]
    pieces += [("▁" + c, -5.0) for c in chars]
    pieces += [("▁" + w, -3.0) for w in words if len(w) > 1]
    return pieces


def tiny_t5_tokenizer(words: Sequence[str]) -> T5Tokenizer:
    from transformers import T5Tokenizer

    # extra_ids=0: no sentinel tokens (they only matter for T5's span-corruption training).
    return T5Tokenizer(vocab=tiny_t5_vocab(words), extra_ids=0, model_max_length=T5_MAX_TOKENS)


def tiny_t5_encoder(
    tokenizer: T5Tokenizer, hidden: int, *, umt5: bool, position_buckets: int, max_distance: int
) -> Any:
    """A 2-layer gated-GELU encoder of width `hidden` (the transformer's text width), 4 heads of 8: a
    T5EncoderModel (FLUX), or UMT5's (Wan: per-layer relative position biases). Random weights from torch's
    current seed (the caller seeds it)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=hidden,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=position_buckets,
        relative_attention_max_distance=max_distance,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return model_class(config)

"""Fakes for the runtime tests: only what a real part cannot show (that something is NOT used)."""

from __future__ import annotations


class NoVAE:
    """Stands in for a family's VAE where it must not be used (previews come from the latents)."""

    def __getattr__(self, name: str):
        raise AssertionError(f"preview touched the VAE ({name})")

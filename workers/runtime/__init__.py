"""The model runtime: family adapters, the per-process model cache, and the stage runners tasks call."""

"""Worker side: the launcher (pools, GPU pinning) and the model runtime."""

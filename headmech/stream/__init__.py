"""Streaming per-head statistics: the engine and its reducers, the attention call (points, blocks), the forward pass, bootstrap intervals."""

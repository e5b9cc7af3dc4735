"""The ``[B, T]`` tail of the fused losses: :mod:`.kernel` (Triton) and :mod:`.eager` (its twin)."""

"""Per-token humanline terms in the log-prob pass: :mod:`.kernel` (Triton) and :mod:`.eager` (its twin)."""

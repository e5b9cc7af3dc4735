"""Selected-token log-probs and their backward: :mod:`.kernel` (Triton) and :mod:`.eager` (its twin)."""

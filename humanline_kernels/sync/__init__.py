"""Humanline reference syncing: in-place, rank-local policy -> reference copy (see docs/sync.md)."""
from ._lookahead import LookaheadReference
from ._state import load_humanline_state, save_humanline_state
from ._syncer import ReferenceSyncer

__all__ = ["ReferenceSyncer", "LookaheadReference", "save_humanline_state", "load_humanline_state"]

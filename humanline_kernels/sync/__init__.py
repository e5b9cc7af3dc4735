"""Humanline reference syncing: in-place, rank-local policy -> reference copy (see docs/sync.md)."""
from ._lookahead import LookaheadReference
from ._syncer import ReferenceSyncer

__all__ = ["ReferenceSyncer", "LookaheadReference"]

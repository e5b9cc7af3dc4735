"""humanline-kernels: fused kernels and cheap reference syncing for humanline DPO, KTO and GRPO.

``import humanline_kernels as hk``; see README.md for the three input levels and docs/design.md for the semantics.
"""
from __future__ import annotations

from . import fused, losses, reference
from ._clip import HumanlineClip
from ._layout import Packed
from .fused import token_logprobs

__version__ = "0.1.0"
__all__ = ["HumanlineClip", "Packed", "token_logprobs", "reference", "losses", "fused", "fused_linear",
           "ReferenceSyncer", "LookaheadReference", "reference_adapter",
           "save_humanline_state", "load_humanline_state", "integrations", "__version__"]


def __getattr__(name):
    # Lazy: the syncer and the integrations pull in torch.distributed / transformers only when asked for.
    if name == "ReferenceSyncer":
        from .sync import ReferenceSyncer
        return ReferenceSyncer
    if name == "reference_adapter":
        from .sync._adapters import reference_adapter
        return reference_adapter
    if name in ("save_humanline_state", "load_humanline_state"):
        from .sync import _state
        return getattr(_state, name)
    if name == "LookaheadReference":
        from .sync._lookahead import LookaheadReference
        return LookaheadReference
    if name in ("fused_linear", "integrations", "sync"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

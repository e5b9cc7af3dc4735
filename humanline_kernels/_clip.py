"""The humanline clip band and the argument checks that every input level shares."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["HumanlineClip", "DEFAULT_CLIP", "clamp_band"]

FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max, without importing torch here


@dataclass(frozen=True)
class HumanlineClip:
    """Asymmetric clamp of each token's log-ratio ``log pi(y_t) - log pi_ref(y_t)`` to ``[log_eps_p, log_eps_r]``.

    The defaults (-1.5, 1.5) are the paper's best setting for DPO, KTO and GRPO. (The authors' HALOs repository
    defaults ``log_epsilon_P`` to -1.0.) The gradient is zero outside the band and 1 on it, its ends included
    (:func:`clamp_band`), whatever the installed torch's ``clamp`` does there. Pass ``clip=None`` to a loss to turn
    clipping off.

    The band must hold 0 (``log_eps_p <= 0 <= log_eps_r``): one that excludes it clamps every token of a policy
    equal to its reference (each step right after a sync) to a constant, with zero gradient, so that step does not
    train at all. (Such a band is usually the ratios ``eps_p``, ``eps_r`` passed instead of their logarithms.)

    An end is ``-inf`` / ``inf`` (no bound on that side) or a finite number within float32's range: the kernels and
    the fp32 log-probs hold the bounds in float32, where a larger one would become infinite on some paths and an
    overflow error on others.
    """

    log_eps_p: float = -1.5
    log_eps_r: float = 1.5

    def __post_init__(self):
        for name in ("log_eps_p", "log_eps_r"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"{name} must be a real number, got {v!r}")
            if math.isfinite(v) and abs(v) > FLOAT32_MAX:
                raise ValueError(f"{name} must be -inf, inf (no bound on that side) or a finite number within "
                                 f"float32's range (|{name}| <= {FLOAT32_MAX:.7g}), got {v!r}")
        if self.log_eps_p > self.log_eps_r:
            raise ValueError(
                f"log_eps_p must be <= log_eps_r, got log_eps_p={self.log_eps_p} > log_eps_r={self.log_eps_r}"
            )
        if not self.log_eps_p <= 0.0 <= self.log_eps_r:
            raise ValueError(
                f"log_eps_p <= 0 <= log_eps_r must hold (bounds of the log-ratio), got log_eps_p={self.log_eps_p}, "
                f"log_eps_r={self.log_eps_r}: a band without 0 clamps every token of a policy equal to its reference "
                "to a constant with zero gradient (the log of the ratio bounds, e.g. log(0.5), log(1.5), is meant)"
            )


DEFAULT_CLIP = HumanlineClip()


def clamp_band(x, lo=None, hi=None):
    """``clamp(x, lo, hi)`` (either bound may be None) whose gradient is 1 on the closed band, its ends included, and
    0 outside; NaN stays NaN. Every eager clamp of this package that carries a gradient goes through it, as the
    kernels do: torch.clamp's own backward at a bound is 1 up to torch 2.13, and 0 (or 0.5 with tensor bounds)
    from torch 2.14."""
    out = x
    if lo is not None:
        out = torch.where(x < lo, lo, out)
    if hi is not None:
        out = torch.where(x > hi, hi, out)
    return out

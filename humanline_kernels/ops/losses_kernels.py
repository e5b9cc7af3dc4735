r"""Triton kernel for the per-token humanline terms, computed in the same pass over the logits as the log-prob.

For each row ``r = (b, t)`` the kernel finds ``lse`` and ``l = z_y - lse`` (online softmax, see
:mod:`.logprobs`), then with ``m = [y != ignore_index]``, ``D = l - l_ref``, ``Dh = clamp(D, p, r)`` (or ``D``):

* ``MODE == 1`` (DPO/KTO): ``val = m * Dh``, ``coef = d val / d l = m * [p <= D <= r]``;
* ``MODE == 2`` (GRPO): ``rho = exp(Dh)``, ``u = -min(A rho, A clamp(rho, 1 - e_lo, 1 + e_hi))``,
  ``k3 = exp(x) - x - 1`` with ``x = l_kl - l``; ``val = m (u + beta k3)`` and
  ``coef = m (-A rho [A rho <= A clamp(rho)] [p <= D <= r] + beta (1 - exp(x)))`` (torch's tie rules for
  ``min`` and ``clamp`` give exactly this).

``aux [4, N]`` fp32 (planes ``N`` apart) holds ``[p < D < r]``, the GRPO low/high clip indicators and ``k3``
(metrics only; 0 for DPO/KTO).
With ``GRAD`` (GRPO) the same program also writes ``dz = w_b * coef * (onehot(y) - softmax(z)) / T`` into
``grad``, where ``w_b = d loss / d val`` is the aggregation weight of row ``b``: the row is read once for the
softmax statistics and once more while the gradient is written (from L2 only while the rows in flight fit in it;
at V >= 32k on an H100 that read mostly goes to HBM, see docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton.language as tl

from ._jit import jit, launcher

from .logprobs import (_row_base, _row_grad_store, _row_logp, _row_zero, _token, block_config, device_guard, row_args,
                       row_strides)

MODE_RATIO, MODE_GRPO = 1, 2


@jit
def _clamp(x, lo, hi):
    # NaN stays NaN (as torch.clamp), so NaN logits give a NaN loss instead of a clamped number. The enum is
    # written inline: bound to a local name, the GPU compiler makes it a tensor and rejects it (the interpreter
    # accepted it; caught by tests/test_compile_gate.py).
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@jit(do_not_specialize=["N", "n0", "off0", "off1"])
def _token_terms_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, w_ptr, g_ptr, g_sb,
                        g_st, val_ptr, coef_ptr, lse_ptr, aux_ptr, N, T, V, inv_t, ignore_index, clip_lo, clip_hi,
                        rho_lo, rho_hi, beta, n0, off0, off1, BLOCK_V: tl.constexpr, MODE: tl.constexpr,
                        CLIP: tl.constexpr, HAS_KL_REF: tl.constexpr, GRAD: tl.constexpr):
    r = tl.program_id(0)  # row of the logits and of the gradient output
    q = _token(r, n0, off0, off1)  # token of the [B, T] inputs and outputs
    plane = N.to(tl.int64)  # aux's plane stride: 3 * N in int32 would wrap past ~716 M tokens
    base, y, valid, lse, _pz, logp = _row_logp(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, r, q, T, V, inv_t,
                                               ignore_index, BLOCK_V, False)
    delta = logp - tl.load(ref_ptr + q)
    if CLIP:
        dh = _clamp(delta, clip_lo, clip_hi)
        inside = valid & (delta > clip_lo) & (delta < clip_hi)
        dpass = (delta >= clip_lo) & (delta <= clip_hi)
    else:
        dh = delta
        inside = valid
        dpass = valid
    dh = tl.where(valid, dh, 0.0)
    tl.store(aux_ptr + q, inside.to(tl.float32))
    if MODE == 1:
        val = dh
        coef = tl.where(valid & dpass, 1.0, 0.0)
        for i in range(1, 4):  # GRPO's planes, zero (the buffer is not zero-filled first: one launch less)
            tl.store(aux_ptr + i * plane + q, 0.0)
    else:
        a = tl.load(adv_ptr + q // T).to(tl.float32)
        rho = tl.exp(dh)
        a1 = a * rho
        a2 = a * _clamp(rho, rho_lo, rho_hi)
        u = -tl.minimum(a1, a2, propagate_nan=tl.PropagateNan.ALL)
        du = tl.where((a1 <= a2) & dpass, -a1, 0.0)
        if HAS_KL_REF:
            lkl = tl.load(klref_ptr + q)
        else:
            lkl = tl.load(ref_ptr + q)
        x = tl.where(valid, lkl - logp, 0.0)
        ex = tl.exp(x)
        k3 = ex - x - 1.0
        # beta == 0 must not turn an infinite k3 into NaN (the reference drops the term then)
        val = tl.where(valid, tl.where(beta != 0.0, u + beta * k3, u), 0.0)
        coef = tl.where(valid, tl.where(beta != 0.0, du + beta * (1.0 - ex), du), 0.0)
        tl.store(aux_ptr + plane + q, (valid & (rho < rho_lo) & (a < 0)).to(tl.float32))
        tl.store(aux_ptr + 2 * plane + q, (valid & (rho > rho_hi) & (a > 0)).to(tl.float32))
        tl.store(aux_ptr + 3 * plane + q, k3)
    tl.store(val_ptr + q, val)
    tl.store(coef_ptr + q, coef)
    tl.store(lse_ptr + q, lse)
    if GRAD:
        out_base = _row_base(g_ptr, r, T, g_sb, g_st)
        if valid:
            _row_grad_store(base, out_base, V, y, lse, coef * tl.load(w_ptr + q // T), inv_t, BLOCK_V)
        else:
            _row_zero(out_base, V, BLOCK_V)


def token_terms_fwd(logits, labels, ref_logps, *, mode, clip, temperature, ignore_index, kl_ref_logps=None,
                    advantages=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, row_weight=None, grad_out=None,
                    out=None, segs=None):
    """Launch the kernel on ``logits [B, T, V]``; returns ``(val, coef, lse, aux)`` (fp32 ``[B, T]`` x3, ``[4, B, T]``).

    ``clip`` is a :class:`~humanline_kernels.HumanlineClip` or None. With ``row_weight [B]`` and ``grad_out``
    (a buffer shaped like ``logits``, possibly ``logits`` itself) the GRPO gradient is written too. ``out``: the
    four outputs to write into (``val``, ``coef``, ``lse`` contiguous ``[B, T]``, ``aux`` ``[4, B, T]`` with any
    plane stride). ``segs`` (a fused-linear chunk's token ranges, see :func:`.logprobs.row_args`): ``logits`` and
    ``grad_out`` are the chunk's ``[n, V]`` buffer, every other tensor the whole batch's; ``out`` is required then.
    """
    grid, T, V, x_sb, x_st, n0, off0, off1 = row_args(logits, labels, segs)
    B = labels.shape[0]
    dev = logits.device
    f32 = dict(dtype=torch.float32, device=dev)
    if out is not None:
        val, coef, lse, aux = out
    else:
        val, coef, lse = (torch.empty((B, T), **f32) for _ in range(3))
        aux = torch.empty((4, B, T), **f32)  # every plane is written by the kernel
    if grid == 0:
        return val, coef, lse, aux
    grad = grad_out is not None
    ref = ref_logps.to(torch.float32).contiguous()
    klr = ref if kl_ref_logps is None else kl_ref_logps.to(torch.float32).contiguous()
    adv = ref if advantages is None else advantages.to(torch.float32).contiguous()
    w = ref if row_weight is None else row_weight.to(torch.float32).contiguous()
    g = grad_out if grad else logits
    block, warps = block_config(logits)
    with device_guard(logits):
        launcher(_token_terms_kernel, logits)[(grid,)](
            logits, x_sb, x_st, labels, labels.stride(0), labels.stride(1), ref, klr, adv, w, g,
            *row_strides(g, T, segs), val, coef, lse, aux, aux.stride(0), T, V, 1.0 / temperature, ignore_index,
            float(clip.log_eps_p) if clip else 0.0, float(clip.log_eps_r) if clip else 0.0,
            1.0 - float(epsilon_low), 1.0 + float(epsilon_high), float(beta), n0, off0, off1, BLOCK_V=block,
            MODE=mode, CLIP=clip is not None, HAS_KL_REF=kl_ref_logps is not None, GRAD=grad, num_warps=warps)
    return val, coef, lse, aux

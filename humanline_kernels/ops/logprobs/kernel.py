r"""Triton kernels for selected-token log-probs: online softmax forward, recomputing backward.

One program per row ``r`` of a canonical view ``logits [B, T, V]`` (row ``r -> (b, t) = (r // T, r % T)``, any
batch/row strides, last stride 1, int64 offsets so ``N * V`` may pass 2^31). With ``z = logits / T_temp``:

* forward: one sweep over ``V`` in fp32 blocks keeps a running max ``m`` and sum ``d = sum exp(z - m)``
  (and ``s = sum exp(z - m) z`` for the entropy); ``lse = m + log d``, ``logp = z_y - lse``,
  ``entropy = lse - s / d``. Only ``lse`` (4 bytes a row) is kept for the backward.
* backward: ``dz = g * (onehot(y) - exp(z - lse)) / T_temp``, written in the logits' dtype into ``out``
  (which may be the logits' own storage: each block is read before it is overwritten by the same program).

Ignored rows (``y == ignore_index``) get ``logp = entropy = 0`` and an all-zero gradient row.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import tuning
from .._jit import COMPILED_DEVICES, custom_op, jit, launcher


def block_config(x: torch.Tensor) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for the rows of ``x [..., V]``: 8 KiB blocks on GPU (4096 bf16/fp16 or 2048 fp32
    elements, two or four 16-byte loads a thread at 8 warps: 4096 fp32 made the entropy variant spill with
    triton 3.6; 2048 elements, 8 a thread, when the rows are not 16-byte aligned: at 16, triton 3.6's ptxas spilled
    4 bytes in the backward), small ones in the interpreter."""
    aligned = rows_aligned(x)
    return _block_config(x.shape[-1], x.element_size() if aligned else 4, x.device.type in COMPILED_DEVICES,
                         tuning.device_name(x.device) if aligned and x.is_cuda else None, x.dtype)


def sweep_config(x: torch.Tensor, family: str = "fwd") -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of the forward sweep (the online softmax of the log-prob and token-terms kernels) over
    the rows of ``x [..., V]``: on GPU 4096 elements at 4 warps, 32 a thread a trip whatever the dtype (512, 4 a
    thread, when the rows are not 16-byte aligned: each element then has a load and an address of its own; 32
    spilled with triton 3.9, 8 with 3.6). Against :func:`block_config`'s 16 a thread at 8 warps, with the folded
    temperature, the flushing ``exp2`` and the per-thread groups of :func:`_row_stats` (no reduction across threads
    in the loop): 6.7 SASS instructions an element of a bf16 row for sm_90 instead of 15.1
    (``python -m bench.compare_compiled``). Small blocks in the interpreter. The same block for every flag
    combination (the entropy and token-map variants compile spill-free at it). ``family``: the tuning table's
    (:mod:`..tuning`; ``"fwd"`` for the log-prob kernel, ``"terms"`` for the token-terms and folded kernels), which
    overrides these defaults on a tuned card."""
    aligned = rows_aligned(x)
    return _sweep_config(x.shape[-1], x.device.type in COMPILED_DEVICES, aligned,
                         tuning.device_name(x.device) if aligned and x.is_cuda else None, x.dtype, family)


def register_budget(x: torch.Tensor, warps: int, programs_per_sm: int = 1) -> dict:
    """``maxnreg`` for a row kernel: the register file's share of ``programs_per_sm`` programs of ``warps`` warps an
    SM (248 at 4 warps, 128 at 16). Without it ptxas 12.8 (triton 3.6) and the 3.9 wheel's pick a lower target of
    their own for some variants and spill a few bytes to meet it (48 registers and 8 bytes spilled where 80 fit; the
    GRPO token-terms kernel with its gradient sweep at T = 1: 96 registers, 4 bytes); with it they take what the
    code needs. Nothing off the compiled path."""
    if x.device.type not in COMPILED_DEVICES:
        return {}
    return {"maxnreg": min(255, 65536 // (32 * warps * programs_per_sm)) // 8 * 8}


def rows_aligned(x: torch.Tensor) -> bool:
    """Whether every row of ``x [..., V]`` starts 16-byte aligned as Triton sees it (pointer and row strides
    divisible by 16): its loads are then 16 bytes wide."""
    bits = x.data_ptr()
    for st in x.stride()[:-1]:  # (a loop, not all() over a generator: this runs on every call's host path)
        bits |= st
    return bits % 16 == 0


@functools.lru_cache(maxsize=None)
def _sweep_config(V, compiled, aligned, card, dtype, family):  # at least GROUP elements (_row_stats' groups)
    tuned = tuning.lookup(family, card, tuning.DTYPES.get(dtype), V)
    if tuned:
        return tuning.clamp(tuned, V, GROUP)
    if compiled:
        return max(min(triton.next_power_of_2(V), 4096 if aligned else 512), GROUP), 4
    return max(min(triton.next_power_of_2(V), 128), GROUP), 1


@functools.lru_cache(maxsize=None)
def _block_config(V, element_size, compiled, card, dtype):  # (asked on every launch: looked up, not recomputed)
    tuned = tuning.lookup("bwd", card, tuning.DTYPES.get(dtype), V)
    if tuned:
        return tuning.clamp(tuned, V, 1)
    if compiled:
        return min(triton.next_power_of_2(V), 8192 // element_size), 8
    return min(triton.next_power_of_2(V), 128), 1


tuning.CLEARS += [_sweep_config.cache_clear, _block_config.cache_clear]


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU even when another one is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@jit
def _row_base(ptr, r, T, s_b, s_t):
    """Pointer to row ``r`` of a ``[B, T, ...]`` view with strides ``(s_b, s_t)``, the offset in int64. The row
    splits into ``(b, t)`` in int32 (:func:`_bt`)."""
    b, t = _bt(r, T)
    return ptr + b.to(tl.int64) * s_b + t.to(tl.int64) * s_t


@jit
def _bt(r, T):
    """``(r // T, r % T)`` in int32: ``r`` is a row or token index (a grid coordinate, or one of the ``B * T`` tokens
    of a batch), below 2^31. In int64 each division is a call to a ~70-instruction subroutine, around which
    ptxas 12.8 (triton 3.6) spilled a few bytes in the folded kernels."""
    r32 = r.to(tl.int32)
    b = r32 // T
    return b, r32 - b * T


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x log2(e))


def _exp2_interpreted(x):
    return tl.exp2(x)


@jit(interpret_as=_exp2_interpreted)
def _exp2_ftz(x):
    """``2^x`` as one ``MUFU.EX2`` (``ex2.approx.ftz.f32``): ``tl.exp2`` lowers to the non-flushing
    ``ex2.approx.f32``, which ptxas guards for a denormal result with a compare and two predicated multiplies. The
    only difference: a result below 2^-126 is 0 instead of a denormal, and a denormal input counts as 0 (2^0 = 1,
    as it rounds to anyway). The interpreter, which runs no PTX, uses ``tl.exp2``."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@jit
def _row_stats(base, V, inv_t, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Online softmax over one row: ``(lse, sum p*z)`` of ``z = x * inv_t`` (second is 0 without ENTROPY).
    ``EVICT_LAST``: the loads ask L2 to keep the row (a second sweep over it follows in the same program).

    The sweep works on the raw logits ``x`` (``inv_t > 0``: the max of ``x`` is the max of ``z``) with ``1/T`` and
    ``log2(e)`` folded into one factor ``c``: each element costs one FFMA and one ``MUFU.EX2``,
    ``exp(z - m/T) = 2^(x c - m c)``. Terms below 2^-126 are flushed to 0 (:func:`_exp2_ftz`): the row's largest
    term is 1, so no fp32 sum that holds it changes."""
    cols = tl.arange(0, BLOCK_V)
    c = inv_t * LOG2E
    # running state per group of GROUP elements (a thread's own: no reduction across threads inside the loop): max
    # of the raw logits m, the shift k = m c (log2 units; -FLT_MAX while m is -inf) the sums are taken against, the
    # sums (each used once after the loop: triton 3.6's thread-locality pass asserts that of a loop's results)
    G: tl.constexpr = BLOCK_V // GROUP
    m = tl.full([G], -float("inf"), tl.float32)
    k = tl.full([G], NO_SHIFT, tl.float32)
    d = tl.zeros([G], dtype=tl.float32)
    s = tl.zeros([G], dtype=tl.float32)
    full = V - V % BLOCK_V
    for v0 in range(0, full, BLOCK_V):  # whole blocks: no mask, no -inf fill
        if EVICT_LAST:
            x = tl.load(base + v0 + cols, eviction_policy="evict_last").to(tl.float32)
        else:
            x = tl.load(base + v0 + cols).to(tl.float32)
        m, k, d, s = _stats_step(tl.reshape(x, [G, GROUP]), m, k, d, s, c, ENTROPY)
    # the last, partial block (always: all -inf when V is a whole number of blocks, which changes nothing; under an
    # `if`, each loop result would have two uses, which triton 3.6's thread-locality pass asserts against)
    col = full + cols
    if EVICT_LAST:
        x = tl.load(base + col, mask=col < V, other=-float("inf"), eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(base + col, mask=col < V, other=-float("inf")).to(tl.float32)
    m, k, d, s = _stats_step(tl.reshape(x, [G, GROUP]), m, k, d, s, c, ENTROPY)
    # the groups into one, against the row's shift kr = fp32(mx c): sum 2^(x c) = 2^kr dsum exactly (each group's
    # sums were taken against its own rounded shift k), so lse = mx / T + (log2 dsum - (mx c - kr)) ln 2 with the
    # large part mx / T exact for T = 1 and the rounding of kr taken back (fma: mx c - kr exactly)
    mx = tl.max(m, 0)
    kr = tl.where(mx == -float("inf"), 0.0, mx * c)
    scale = _exp2_ftz(k - kr)  # 0 for a group of -inf (k = -FLT_MAX)
    dsum = tl.sum(d * scale, 0)
    lse = mx * inv_t + (tl.log2(dsum) - tl.where(mx == -float("inf"), 0.0, tl.fma(mx, c, -kr))) * LN2
    if ENTROPY:
        return lse, tl.sum(s * scale, 0) * inv_t / dsum
    return lse, 0.0


GROUP = tl.constexpr(8)
LN2 = tl.constexpr(0.6931471805599453)
NO_SHIFT = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: the shift of a group of -inf (x c - k stays -inf, not NaN)


@jit
def _stats_step(x, m, k, d, s, c, ENTROPY: tl.constexpr):
    """One block ``x [groups, GROUP]`` of raw logits into each group's running max ``m``, shift ``k = m c``, sum
    ``d`` of ``2^(x c - k)`` and sum ``s`` of those times ``x``; the sums are rescaled by ``2^(k_old - k_new)``,
    exactly the change of the shift they were taken against."""
    m_new = tl.maximum(m, tl.max(x, 1))
    # a group (or prefix) of -inf keeps m == -inf: shift by -FLT_MAX, so that exp2 gives 0 (not NaN) and the
    # rescale of its empty sums 1
    k_new = tl.where(m_new == -float("inf"), NO_SHIFT, m_new * c)
    alpha = _exp2_ftz(k - k_new)
    e = _exp2_ftz(tl.fma(x, c, -k_new[:, None]))  # one FFMA whatever TRITON_DEFAULT_FP_FUSION says
    d = d * alpha + tl.sum(e, 1)
    if ENTROPY:
        s = s * alpha + tl.sum(e * tl.where(e > 0, x, 0.0), 1)  # 0 * -inf would be NaN
    return m_new, k_new, d, s


@jit
def _row_grad_store(base, out_base, V, y, lse, g, inv_t, BLOCK_V: tl.constexpr, STREAM: tl.constexpr):
    """Write ``g * (onehot(y) - exp(z - lse)) * inv_t`` for one row into ``out_base`` (may equal ``base``).

    ``p = 2^((x / T - lse) log2(e))``: an FFMA (``x / T - lse`` rounded once) and a multiply before the ``exp2``,
    which keeps its denormal results here (a gradient entry is not a term of a sum that holds a 1); the one-hot
    compares each column with the label in int32 (``y`` is in ``[0, V)``; another value matches no column). Whole
    blocks without masks.
    ``STREAM``: the row is read for the last time (``evict_first``) and the gradient is written with streaming
    stores (``.cs``), so that neither displaces the rows that other programs still have to read from L2."""
    cols = tl.arange(0, BLOCK_V)
    gs = g * inv_t
    y32 = tl.where((y >= 0) & (y < V), y, -1).to(tl.int32)
    full = V - V % BLOCK_V
    for v0 in range(0, full, BLOCK_V):
        if STREAM:
            x = tl.load(base + v0 + cols, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(base + v0 + cols).to(tl.float32)
        dz = tl.fma(-gs, tl.exp2(tl.fma(x, inv_t, -lse) * LOG2E), tl.where(cols == y32 - v0, gs, 0.0))
        if STREAM:
            tl.store(out_base + v0 + cols, dz.to(out_base.dtype.element_ty), cache_modifier=".cs")
        else:
            tl.store(out_base + v0 + cols, dz.to(out_base.dtype.element_ty))
    if full < V:
        col = full + cols
        if STREAM:
            x = tl.load(base + col, mask=col < V, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(base + col, mask=col < V, other=0.0).to(tl.float32)
        dz = tl.fma(-gs, tl.exp2(tl.fma(x, inv_t, -lse) * LOG2E), tl.where(col == y32, gs, 0.0))
        if STREAM:
            tl.store(out_base + col, dz.to(out_base.dtype.element_ty), mask=col < V, cache_modifier=".cs")
        else:
            tl.store(out_base + col, dz.to(out_base.dtype.element_ty), mask=col < V)


@jit
def _row_grad_store_entropy(base, out_base, V, y, lse, g, gh, h, inv_t, BLOCK_V: tl.constexpr):
    """:func:`_row_grad_store` plus the entropy's gradient: ``(g (onehot(y) - p) - gh p (log p + h)) * inv_t`` with
    ``h`` the row's entropy and ``gh`` its upstream gradient (``dH/dz = -p (log p + H)``; 0 where ``p`` is 0)."""
    cols = tl.arange(0, BLOCK_V)
    gs = g * inv_t
    ghs = gh * inv_t
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32) * inv_t
        logp = z - lse
        p = tl.exp(logp)
        # p == 0 (z == -inf) adds 0: log p is replaced before the product, so no 0 * -inf is formed
        dz = gs * (tl.where(c == y, 1.0, 0.0) - p) - ghs * p * (tl.where(p > 0, logp, 0.0) + h)
        tl.store(out_base + c, dz.to(out_base.dtype.element_ty), mask=c < V)


@jit
def _row_zero(out_base, V, BLOCK_V: tl.constexpr, STREAM: tl.constexpr = False):
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        if STREAM:
            tl.store(out_base + c, tl.zeros([BLOCK_V], dtype=out_base.dtype.element_ty), mask=c < V,
                     cache_modifier=".cs")
        else:
            tl.store(out_base + c, tl.zeros([BLOCK_V], dtype=out_base.dtype.element_ty), mask=c < V)


@jit
def _token(r, n0, off0, off1, tok_ptr, Q, TOKEN_MAP: tl.constexpr):
    """Token ``q`` (int64) of the ``[B, T]`` inputs and outputs for row ``r`` of the logits: ``r + off0`` for the
    first ``n0`` rows, ``r + off1`` after them, or with ``TOKEN_MAP`` the map's entry ``tok[r]``. The dense
    logits-level ops pass ``(N, 0, 0)`` (``q = r``); a fused-linear chunk (logits in a buffer of its own) passes its
    token ranges, at most two (a DPO chunk: chosen rows, then their rejected partners); a packed batch, or a chunk
    of the supervised tokens only, passes the map (any rows to any tokens: docs/fused_linear.md). A map entry is
    clamped into the ``Q`` tokens: whatever the map holds (boundaries left unchecked by ``validate=False``), no
    program addresses outside the ``[B, T]`` tensors."""
    r64 = r.to(tl.int64)
    if TOKEN_MAP:
        return tl.minimum(tl.maximum(tl.load(tok_ptr + r64).to(tl.int64), 0), Q - 1)
    return r64 + tl.where(r64 < n0, off0, off1)


@jit
def _row_logp(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, r, n0, off0, off1, tok_ptr, Q, T, V, inv_t, ignore_index,
              BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, TOKEN_MAP: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Logits row ``r``, its token ``q`` (:func:`_token`): ``(row pointer, q, label, valid, lse, sum p*z, logp)``;
    ``logp = z_y - lse``, 0 where ignored, NaN for a label outside ``[0, V)`` (only unchecked labels,
    ``validate=False``, reach the kernel so: the logit is not read, and the loss is NaN)."""
    base = _row_base(x_ptr, r, T, x_sb, x_st)
    lse, pz = _row_stats(base, V, inv_t, BLOCK_V, ENTROPY, EVICT_LAST)
    # the token and its label after the sweep: nothing but the row pointer stays live across it (the entropy
    # variant spilled under triton 3.6 with the label, and with the token map's entry, loaded first)
    q = _token(r, n0, off0, off1, tok_ptr, Q, TOKEN_MAP)
    y = tl.load(_row_base(y_ptr, q, T, y_sb, y_st))
    valid = y != ignore_index
    in_vocab = (y >= 0) & (y < V)
    zy = tl.load(base + tl.where(valid & in_vocab, y, 0)).to(tl.float32) * inv_t
    return base, q, y, valid, lse, pz, tl.where(valid, tl.where(in_vocab, zy - lse, float("nan")), 0.0)


@jit(do_not_specialize=["Q", "n0", "off0", "off1"])
def _logprobs_fwd_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, logp_ptr, lse_ptr, ent_ptr, tok_ptr, Q, T, V, inv_t,
                         ignore_index, n0, off0, off1, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr,
                         TOKEN_MAP: tl.constexpr):
    """Logits row ``r``, token ``q`` (:func:`_token`): ``logp``, ``lse`` (and the entropy) of token ``q``."""
    r = tl.program_id(0)
    _base, q, _y, valid, lse, pz, logp = _row_logp(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, r, n0, off0, off1, tok_ptr,
                                                   Q, T, V, inv_t, ignore_index, BLOCK_V, ENTROPY, TOKEN_MAP, False)
    tl.store(logp_ptr + q, logp)
    tl.store(lse_ptr + q, lse)
    if ENTROPY:
        tl.store(ent_ptr + q, tl.where(valid, lse - pz, 0.0))


@jit(do_not_specialize=["Q", "n0", "off0", "off1"])
def _logprobs_bwd_kernel(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, lse_ptr, g_ptr, w_ptr, w2_ptr, go_ptr, gh_ptr, h_ptr,
                         o_ptr, o_sb, o_st, tok_ptr, Q, T, V, inv_t, ignore_index, n0, off0, off1, has_w2, has_go,
                         BLOCK_V: tl.constexpr, ROW_WEIGHT: tl.constexpr, ENTROPY: tl.constexpr,
                         TOKEN_MAP: tl.constexpr):
    """Logits row ``r``, token ``q`` (:func:`_token`): ``g = g[q]``, or with ``ROW_WEIGHT`` (the fused losses and
    the sequence sums) ``g = go * (w[b] * g[q] + w2[b])``: ``g[q]`` the token's ``coef``, ``w[b]`` its row's
    ``d loss / d val``, ``w2[b]`` (when ``has_w2``) its row's ``d loss / d logp`` of a term in the plain log-probs
    (the policy sums), and ``go`` the loss's upstream gradient (1 when ``has_go == 0``), all read on the device
    (the backward is this one launch). With ``ENTROPY`` the token's entropy ``h[q]`` has the upstream gradient
    ``gh[q]`` too (a differentiable entropy: the entropy bonus of GRPO)."""
    r = tl.program_id(0)
    q = _token(r, n0, off0, off1, tok_ptr, Q, TOKEN_MAP)
    base = _row_base(x_ptr, r, T, x_sb, x_st)
    out_base = _row_base(o_ptr, r, T, o_sb, o_st)
    y = tl.load(_row_base(y_ptr, q, T, y_sb, y_st))
    if y != ignore_index:
        g = tl.load(g_ptr + q).to(tl.float32)
        if ROW_WEIGHT:
            b = _bt(q, T)[0]
            g = g * tl.load(w_ptr + b)
            if has_w2 != 0:
                g = g + tl.load(w2_ptr + b)
            if has_go != 0:
                g = g * tl.load(go_ptr).to(tl.float32)
        if ENTROPY:
            _row_grad_store_entropy(base, out_base, V, y, tl.load(lse_ptr + q), g, tl.load(gh_ptr + q),
                                    tl.load(h_ptr + q), inv_t, BLOCK_V)
        else:
            _row_grad_store(base, out_base, V, y, tl.load(lse_ptr + q), g, inv_t, BLOCK_V, False)
    else:
        _row_zero(out_base, V, BLOCK_V)


@jit
def _scale_row(src, dst, s, V, BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(src + c, mask=c < V, other=0.0).to(tl.float32)
        tl.store(dst + c, (x * s).to(dst.dtype.element_ty), mask=c < V)


@jit
def _scale_rows_kernel(x_ptr, x_sb, x_st, s_ptr, out_ptr, o_sb, o_st, T, V, BLOCK_V: tl.constexpr,
                       OUT: tl.constexpr):
    """``x *= s`` in place, skipped on the device when ``s == 1`` (no host sync to find out); with ``OUT``,
    ``out = x * s`` in ``out``'s dtype, ``s == 1`` included."""
    s = tl.load(s_ptr).to(tl.float32)
    r = tl.program_id(0)
    if OUT:
        _scale_row(_row_base(x_ptr, r, T, x_sb, x_st), _row_base(out_ptr, r, T, o_sb, o_st), s, V, BLOCK_V)
    elif s != 1.0:
        base = _row_base(x_ptr, r, T, x_sb, x_st)
        _scale_row(base, base, s, V, BLOCK_V)


# ------------------------------------------------------------------ launchers (torch.library ops) and their callers
def logits_rows(x, T):
    """``(rows, s_b, s_t)`` with which the row kernels address the logits rows of ``x``: a ``[B, T, V]`` view with
    its own batch and row strides, or a fused-linear chunk's ``[n, V]`` buffer (row ``r`` at ``r * stride``,
    written ``(r // T) * (T * stride) + (r % T) * stride`` by the same code)."""
    if x.dim() == 2:
        return x.shape[0], T * x.stride(0), x.stride(0)
    return x.shape[0] * x.shape[1], x.stride(0), x.stride(1)


def chunk_rows(segs, N):
    """``(n0, off0, off1, tok)`` for :func:`_token`: the whole batch (``segs`` None: logits row ``r`` is token ``r``
    of the ``N`` tokens), a fused-linear chunk's token ranges ``((s0, e0), [(s1, e1)])`` (its ``[n, V]`` buffer
    holds the tokens ``s0..e0``, then ``s1..e1``), or a token map (an int64 tensor: row ``r`` is token ``segs[r]``)."""
    if segs is None:
        return N, 0, 0, None
    if isinstance(segs, Tensor):
        return 0, 0, 0, segs
    (s0, e0), *rest = segs
    n0 = e0 - s0
    if not rest:
        return n0, s0, s0, None
    (s1, _e1), = rest
    return n0, s0, s1 - n0, None


@custom_op("logprobs_fwd_out", mutates_args=("logp", "lse", "ent"))
def _fwd_out(logits: Tensor, labels: Tensor, logp: Tensor, lse: Tensor, ent: Optional[Tensor], inv_t: float,
             ignore_index: int, n0: int, off0: int, off1: int, tok: Optional[Tensor]) -> None:
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    if rows == 0:
        return
    block, warps = sweep_config(logits)
    with device_guard(logits):
        launcher(_logprobs_fwd_kernel, logits)[(rows,)](
            # data
            x_ptr=logits, y_ptr=labels, logp_ptr=logp, lse_ptr=lse, ent_ptr=logp if ent is None else ent,
            tok_ptr=labels if tok is None else tok,
            # strides
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1),
            # sizes, scalars and the chunk's token ranges or map
            Q=labels.numel(), T=T, V=logits.shape[-1], inv_t=inv_t, ignore_index=ignore_index, n0=n0, off0=off0,
            off1=off1,
            # constants
            BLOCK_V=block, ENTROPY=ent is not None, TOKEN_MAP=tok is not None, num_warps=warps)


def _like(t):
    return dict(dtype=t.dtype, device=t.device)


def logprobs_fwd(logits, labels, temperature, ignore_index, return_entropy, out=None, segs=None):
    """``(logp, lse, entropy or None)``, fp32 ``[B, T]``, of ``logits [B, T, V]`` (last stride 1) and
    ``labels [B, T]``; the Triton twin of :func:`.eager.logprobs_fwd`. ``out``: the (two or three) contiguous
    outputs to write into. ``segs``: ``logits`` is a fused-linear chunk's ``[n, V]`` buffer and ``labels`` and
    ``out`` the whole batch's (:func:`chunk_rows`); ``out`` is required then."""
    if out is None:
        B, T = labels.shape
        alloc = torch.zeros if isinstance(segs, Tensor) else torch.empty  # a token map may skip positions
        logp = alloc((B, T), dtype=torch.float32, device=logits.device)
        out = logp, alloc((B, T), **_like(logp)), alloc((B, T), **_like(logp)) if return_entropy else None
    logp, lse, ent = out
    _fwd_out(logits, labels, logp, lse, ent, 1.0 / temperature, ignore_index, *chunk_rows(segs, labels.numel()))
    return logp, lse, ent


def _bwd_launch(logits: Tensor, labels: Tensor, lse: Tensor, g: Tensor, w: Optional[Tensor], w2: Optional[Tensor],
                go: Optional[Tensor], gh: Optional[Tensor], h: Optional[Tensor], out: Optional[Tensor], inv_t: float,
                ignore_index: int, n0: int, off0: int, off1: int, tok: Optional[Tensor]) -> None:
    out = logits if out is None else out  # None: in place
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    if rows == 0:
        return
    _, o_sb, o_st = logits_rows(out, T)
    block, warps = block_config(logits)
    with device_guard(logits):
        launcher(_logprobs_bwd_kernel, logits)[(rows,)](
            # data
            x_ptr=logits, y_ptr=labels, lse_ptr=lse, g_ptr=g, w_ptr=g if w is None else w,
            w2_ptr=g if w2 is None else w2, go_ptr=g if go is None else go, gh_ptr=g if gh is None else gh,
            h_ptr=g if h is None else h, o_ptr=out, tok_ptr=labels if tok is None else tok,
            # strides
            x_sb=x_sb, x_st=x_st, y_sb=labels.stride(0), y_st=labels.stride(1), o_sb=o_sb, o_st=o_st,
            # sizes, scalars and the chunk's token ranges or map
            Q=labels.numel(), T=T, V=logits.shape[-1], inv_t=inv_t, ignore_index=ignore_index, n0=n0, off0=off0,
            off1=off1, has_w2=int(w2 is not None), has_go=int(go is not None),
            # constants
            BLOCK_V=block, ROW_WEIGHT=w is not None, ENTROPY=gh is not None, TOKEN_MAP=tok is not None,
            num_warps=warps)


# one launcher, two ops: into a new buffer, or over the logits (out=None; a mutated argument of an op may not alias
# another of its arguments)
_bwd_out = custom_op("logprobs_bwd_out", mutates_args=("out",))(_bwd_launch)
_bwd_inplace = custom_op("logprobs_bwd_inplace", mutates_args=("logits",), bumps=(0,))(_bwd_launch)


def logprobs_bwd(logits, labels, lse, grad_logp, temperature, ignore_index, out=None, row_weight=None,
                 grad_loss=None, segs=None, row_add=None, grad_entropy=None, entropy=None):
    """``dlogits = g * (onehot(y) - softmax(z / T)) / T`` in the logits' dtype, into ``out`` (new, or ``logits``
    itself: then in place, and the logits' version counter is bumped), the Triton twin of
    :func:`.eager.logprobs_bwd`. ``g`` is ``grad_logp``, or with ``row_weight [B]`` (a fused loss's backward)
    ``grad_loss * (row_weight[b] * grad_logp[b, t] + row_add[b])`` (``grad_loss`` 0-d, read on the device;
    ``row_add [B]``, with ``row_weight`` only, the gradient of a term in the row's plain log-probs). ``segs``:
    ``logits`` and ``out`` are a fused-linear chunk's ``[n, V]`` buffer and the other tensors the whole batch's
    (:func:`chunk_rows`). ``grad_entropy`` (with the forward's ``entropy``, both shaped like ``labels``) adds the
    entropy's gradient ``-grad_entropy * p (log p + H) / T``."""
    inv_t = 1.0 / temperature
    ranges = chunk_rows(segs, labels.numel())
    # the kernel reads g, lse (and w) at flat token indices, so any shape with the labels' count will do; autograd
    # may hand an expanded (stride 0) gradient, which contiguous() materialises
    g = grad_logp.contiguous()
    go = None if grad_loss is None else grad_loss.reshape(1)
    gh = h = None
    if grad_entropy is not None:
        gh = grad_entropy.reshape(labels.shape).to(torch.float32).contiguous()
        h = entropy.reshape(labels.shape).contiguous()
    args = (logits, labels, lse.contiguous(), g, row_weight, row_add, go, gh, h)
    if out is logits:
        _bwd_inplace(*args, None, inv_t, ignore_index, *ranges)
        return logits
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _bwd_out(*args, out, inv_t, ignore_index, *ranges)
    return out


@custom_op("scale_rows_out", mutates_args=("out",))
def _scale_rows_out(x: Tensor, scale: Tensor, out: Tensor) -> None:
    B, T, V = x.shape
    if B * T == 0:
        return
    block, warps = block_config(x if x.element_size() >= out.element_size() else out)  # the wider dtype's
    with device_guard(x):
        launcher(_scale_rows_kernel, x)[(B * T,)](
            # out is x: in place (through _scale_rows), skipped on the device when the scale is 1
            x_ptr=x, s_ptr=scale, out_ptr=out, x_sb=x.stride(0), x_st=x.stride(1), o_sb=out.stride(0),
            o_st=out.stride(1), T=T, V=V, BLOCK_V=block, OUT=out is not x, num_warps=warps)


@custom_op("scale_rows_", mutates_args=("x",), bumps=(0,))
def _scale_rows(x: Tensor, scale: Tensor) -> None:
    _scale_rows_out.fn(x, scale, x)


def scale_rows_(x, scale):
    """``x [B, T, V] *= scale`` (0-d tensor) in place; a no-op on the device when ``scale == 1``."""
    _scale_rows(x, scale.reshape(1))
    return x


def scaled(x, scale, dtype):
    """``x * scale`` (``x`` contiguous, any shape; ``scale`` 0-d) as a new tensor of ``dtype``, in one pass: the
    fused-linear ``dW`` (fp32 accumulator -> weight dtype) times ``grad_output``. ``torch.mul(x, scale, out=)``
    with a 0-d CUDA ``scale`` and a dtype change takes TensorIterator's non-vectorised path, a fraction of the
    bandwidth."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    shape = (1, 1, -1) if x.dim() == 1 else (1, -1, x.shape[-1])
    _scale_rows_out(x.view(shape), scale.reshape(1), out.view(shape))  # the kernel reads any float scale
    return out

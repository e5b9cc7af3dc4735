r"""What the kernels share: row addressing, the online softmax sweep, the per-token humanline terms and their clamp,
the gradient of a row, and the ``[B, T]`` tails' tiles, as ``@jit`` device functions imported by name; and on the
host, the launch shapes and configurations every launcher asks for.

A row kernel runs one program per row ``r`` of a canonical view ``logits [B, T, V]`` (row ``r -> (b, t) =
(r // T, r % T)``, any batch/row strides, last stride 1, int64 offsets so ``N * V`` may pass 2^31) and reads and
writes the ``[B, T]`` tensors at its token ``q`` (:func:`row_token`). With ``z = logits / T_temp`` a sweep keeps a
running max and sum of ``exp(z - m)`` (:func:`row_stats`); ``lse = m + log d`` and ``logp = z_y - lse``
(:func:`row_logp`). :func:`row_terms` adds the humanline clamp and a loss's per-token term (see
:mod:`.token_terms`); :func:`row_grad_store` writes ``g * (onehot(y) - softmax(z)) / T_temp``. A tail kernel is one
program over ``[B, T]`` (or over per-tile partial sums, :mod:`.fold`) in ``[BLOCK_B, BLOCK_T]`` tiles
(:func:`tiles`, :func:`row_sums`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import tuning
from ._jit import COMPILED_DEVICES, jit
from .constants import N_METRICS


# ------------------------------------------------------------------ launch configurations (host)
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
    temperature, the flushing ``exp2`` and the per-thread groups of :func:`row_stats` (no reduction across threads
    in the loop): 6.7 SASS instructions an element of a bf16 row for sm_90 instead of 15.1
    (``python -m bench.compare_compiled``). Small blocks in the interpreter. The same block for every flag
    combination (the entropy and token-map variants compile spill-free at it). ``family``: the tuning table's
    (:mod:`.tuning`; ``"fwd"`` for the log-prob kernel, ``"terms"`` for the token-terms and folded kernels), which
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
def _sweep_config(V, compiled, aligned, card, dtype, family):  # at least GROUP elements (row_stats' groups)
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


def logits_rows(x, T):
    """``(rows, s_b, s_t)`` with which the row kernels address the logits rows of ``x``: a ``[B, T, V]`` view with
    its own batch and row strides, or a fused-linear chunk's ``[n, V]`` buffer (row ``r`` at ``r * stride``,
    written ``(r // T) * (T * stride) + (r % T) * stride`` by the same code)."""
    if x.dim() == 2:
        return x.shape[0], T * x.stride(0), x.stride(0)
    return x.shape[0] * x.shape[1], x.stride(0), x.stride(1)


def chunk_rows(segs, N):
    """``(n0, off0, off1, tok)`` for :func:`row_token`: the whole batch (``segs`` None: logits row ``r`` is token ``r``
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


def tiles(t: torch.Tensor, block_t: int = 128, *, rows: int) -> tuple[int, int, int]:
    """``(BLOCK_B, BLOCK_T, num_warps)`` for a program that walks ``rows`` rows: ``4 x block_t`` tiles on GPU, 512
    elements by default (2 a thread: 1024 made the GRPO kernel spill under triton 3.6, 2048 under 3.9; the compile
    gate checks); with 1 or 2 rows the same elements as ``1 x 4 block_t`` or ``2 x 2 block_t``, since the loop is
    latency bound by its trip count (``4 x 64`` tiles over one row would leave 3/4 of each empty). In the
    interpreter ``2 x 4`` (one
    row: ``1 x 8``), so that the small test shapes cross tile boundaries in both dimensions."""
    bb = 1 if rows <= 1 else 2 if rows == 2 else 4
    if t.device.type in COMPILED_DEVICES:
        return bb, block_t * 4 // bb, 8
    return (1, 8, 1) if bb == 1 else (2, 4, 1)


def loss_outputs(like, B, name):
    f32 = dict(dtype=torch.float32, device=like.device)
    return torch.empty((), **f32), torch.empty((N_METRICS[name],), **f32), torch.empty((B,), **f32)


def band(clip) -> dict:
    """The clip band as a launch passes it, by name: whether the log-ratio is clamped (``clip``, the ``CLIP``
    constexpr) and the band's ends ``log_eps_p``, ``log_eps_r`` of ``clip`` (an ``hk.HumanlineClip``; 0.0 when it
    is None)."""
    if clip is None:
        return {"clip": False, "log_eps_p": 0.0, "log_eps_r": 0.0}
    return {"clip": True, "log_eps_p": float(clip.log_eps_p), "log_eps_r": float(clip.log_eps_r)}


def as_f32(t):
    return None if t is None else t.to(torch.float32).contiguous()


# ------------------------------------------------------------------ row addressing and the softmax sweep (device)
@jit
def row_base(ptr, r, T, s_b, s_t):
    """Pointer to row ``r`` of a ``[B, T, ...]`` view with strides ``(s_b, s_t)``, the offset in int64. The row
    splits into ``(b, t)`` in int32 (:func:`split_token`)."""
    b, t = split_token(r, T)
    return ptr + b.to(tl.int64) * s_b + t.to(tl.int64) * s_t


@jit
def split_token(r, T):
    """``(r // T, r % T)`` in int32: ``r`` is a row or token index (a grid coordinate, or one of the ``B * T`` tokens
    of a batch), below 2^31. In int64 each division is a call to a ~70-instruction subroutine, around which
    ptxas 12.8 (triton 3.6) spilled a few bytes in the folded kernels."""
    r32 = r.to(tl.int32)
    b = r32 // T
    return b, r32 - b * T


@jit
def row_token(r, n0, off0, off1, tok_ptr, Q, TOKEN_MAP: tl.constexpr):
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


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x log2(e))


def _exp2_interpreted(x):
    return tl.exp2(x)


@jit(interpret_as=_exp2_interpreted)
def exp2_ftz(x):
    """``2^x`` as one ``MUFU.EX2`` (``ex2.approx.ftz.f32``): ``tl.exp2`` lowers to the non-flushing
    ``ex2.approx.f32``, which ptxas guards for a denormal result with a compare and two predicated multiplies. The
    only difference: a result below 2^-126 is 0 instead of a denormal, and a denormal input counts as 0 (2^0 = 1,
    as it rounds to anyway). The interpreter, which runs no PTX, uses ``tl.exp2``."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@jit
def row_stats(base, V, inv_temperature, BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Online softmax over one row: ``(lse, sum p*z)`` of ``z = x * inv_temperature`` (second is 0 without ENTROPY).
    ``EVICT_LAST``: the loads ask L2 to keep the row (a second sweep over it follows in the same program).

    The sweep works on the raw logits ``x`` (``inv_temperature > 0``: the max of ``x`` is the max of ``z``) with
    ``1/T`` and ``log2(e)`` folded into one factor ``c``: each element costs one FFMA and one ``MUFU.EX2``,
    ``exp(z - m/T) = 2^(x c - m c)``. Terms below 2^-126 are flushed to 0 (:func:`exp2_ftz`): the row's largest
    term is 1, so no fp32 sum that holds it changes."""
    cols = tl.arange(0, BLOCK_V)
    c = inv_temperature * LOG2E
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
        m, k, d, s = stats_step(tl.reshape(x, [G, GROUP]), m, k, d, s, c, ENTROPY)
    # the last, partial block (always: all -inf when V is a whole number of blocks, which changes nothing; under an
    # `if`, each loop result would have two uses, which triton 3.6's thread-locality pass asserts against)
    col = full + cols
    if EVICT_LAST:
        x = tl.load(base + col, mask=col < V, other=-float("inf"), eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(base + col, mask=col < V, other=-float("inf")).to(tl.float32)
    m, k, d, s = stats_step(tl.reshape(x, [G, GROUP]), m, k, d, s, c, ENTROPY)
    # the groups into one, against the row's shift kr = fp32(mx c): sum 2^(x c) = 2^kr dsum exactly (each group's
    # sums were taken against its own rounded shift k), so lse = mx / T + (log2 dsum - (mx c - kr)) ln 2 with the
    # large part mx / T exact for T = 1 and the rounding of kr taken back (fma: mx c - kr exactly)
    mx = tl.max(m, 0)
    kr = tl.where(mx == -float("inf"), 0.0, mx * c)
    scale = exp2_ftz(k - kr)  # 0 for a group of -inf (k = -FLT_MAX)
    dsum = tl.sum(d * scale, 0)
    lse = mx * inv_temperature + (tl.log2(dsum) - tl.where(mx == -float("inf"), 0.0, tl.fma(mx, c, -kr))) * LN2
    if ENTROPY:
        return lse, tl.sum(s * scale, 0) * inv_temperature / dsum
    return lse, 0.0


GROUP = tl.constexpr(8)


LN2 = tl.constexpr(0.6931471805599453)


NO_SHIFT = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: the shift of a group of -inf (x c - k stays -inf, not NaN)


@jit
def stats_step(x, m, k, d, s, c, ENTROPY: tl.constexpr):
    """One block ``x [groups, GROUP]`` of raw logits into each group's running max ``m``, shift ``k = m c``, sum
    ``d`` of ``2^(x c - k)`` and sum ``s`` of those times ``x``; the sums are rescaled by ``2^(k_old - k_new)``,
    exactly the change of the shift they were taken against."""
    m_new = tl.maximum(m, tl.max(x, 1))
    # a group (or prefix) of -inf keeps m == -inf: shift by -FLT_MAX, so that exp2 gives 0 (not NaN) and the
    # rescale of its empty sums 1
    k_new = tl.where(m_new == -float("inf"), NO_SHIFT, m_new * c)
    alpha = exp2_ftz(k - k_new)
    e = exp2_ftz(tl.fma(x, c, -k_new[:, None]))  # one FFMA whatever TRITON_DEFAULT_FP_FUSION says
    d = d * alpha + tl.sum(e, 1)
    if ENTROPY:
        s = s * alpha + tl.sum(e * tl.where(e > 0, x, 0.0), 1)  # 0 * -inf would be NaN
    return m_new, k_new, d, s


@jit
def row_logp(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, r, n0, off0, off1, tok_ptr, Q, T, V, inv_temperature, ignore_index,
             BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr, TOKEN_MAP: tl.constexpr, EVICT_LAST: tl.constexpr):
    """Logits row ``r``, its token ``q`` (:func:`row_token`): ``(row pointer, q, label, valid, lse, sum p*z, logp)``;
    ``logp = z_y - lse``, 0 where ignored, NaN for a label outside ``[0, V)`` (only unchecked labels,
    ``validate=False``, reach the kernel so: the logit is not read, and the loss is NaN)."""
    base = row_base(x_ptr, r, T, x_sb, x_st)
    lse, pz = row_stats(base, V, inv_temperature, BLOCK_V, ENTROPY, EVICT_LAST)
    # the token and its label after the sweep: nothing but the row pointer stays live across it (the entropy
    # variant spilled under triton 3.6 with the label, and with the token map's entry, loaded first)
    q = row_token(r, n0, off0, off1, tok_ptr, Q, TOKEN_MAP)
    y = tl.load(row_base(y_ptr, q, T, y_sb, y_st))
    valid = y != ignore_index
    in_vocab = (y >= 0) & (y < V)
    zy = tl.load(base + tl.where(valid & in_vocab, y, 0)).to(tl.float32) * inv_temperature
    return base, q, y, valid, lse, pz, tl.where(valid, tl.where(in_vocab, zy - lse, float("nan")), 0.0)


# ------------------------------------------------------------------ a token's humanline terms, a row's gradient
@jit
def clamp(x, lo, hi):
    # NaN stays NaN (as torch.clamp), so NaN logits give a NaN loss instead of a clamped number. The enum is
    # written inline: bound to a local name, the GPU compiler makes it a tensor and rejects it (the interpreter
    # accepted it; caught by tests/test_compile_gate.py).
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@jit
def row_terms(x_ptr, x_sb, x_st, y_ptr, y_sb, y_st, ref_ptr, klref_ptr, adv_ptr, adv_sb, adv_st, val_ptr, coef_ptr,
              lse_ptr, aux_ptr, tok_ptr, r, N, Q, T, V, inv_temperature, ignore_index, log_eps_p, log_eps_r, ratio_low,
              ratio_high, beta, n0, off0, off1, BLOCK_V: tl.constexpr, MODE: tl.constexpr, CLIP: tl.constexpr,
              HAS_KL_REF: tl.constexpr, TOKEN_MAP: tl.constexpr, EVICT_LAST: tl.constexpr):
    """The per-token terms of logits row ``r`` (:mod:`.token_terms` states them), written at its token ``q
    (:func:`row_token`); returns ``(row pointer, q, label, valid, lse, coef)`` for a gradient sweep after it.
    ``EVICT_LAST``: the softmax sweep asks L2 to keep the row (a second sweep of it follows)."""
    plane = N.to(tl.int64)  # aux's plane stride: 3 * N in int32 would wrap past ~716 M tokens
    # q: the token of the [B, T] inputs and outputs (:func:`row_token`)
    base, q, y, valid, lse, _pz, logp = row_logp(
        x_ptr=x_ptr, x_sb=x_sb, x_st=x_st, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, r=r, n0=n0, off0=off0,
        off1=off1, tok_ptr=tok_ptr, Q=Q, T=T, V=V, inv_temperature=inv_temperature, ignore_index=ignore_index,
        BLOCK_V=BLOCK_V, ENTROPY=False, TOKEN_MAP=TOKEN_MAP, EVICT_LAST=EVICT_LAST)
    delta = logp - tl.load(ref_ptr + q)
    if CLIP:
        dh = clamp(delta, log_eps_p, log_eps_r)
        inside = valid & (delta > log_eps_p) & (delta < log_eps_r)
        dpass = (delta >= log_eps_p) & (delta <= log_eps_r)
    else:
        dh = delta
        inside = valid
        dpass = valid
    dh = tl.where(valid, dh, 0.0)
    tl.store(aux_ptr + q, inside.to(tl.float32))
    if MODE == 1:
        val = dh
        coef = tl.where(valid & dpass, 1.0, 0.0)
        tl.store(aux_ptr + plane + q, logp)  # the policy's own log-prob (sequence sums, SFT terms)
        for i in range(2, 4):  # GRPO's planes, zero (the buffer is not zero-filled first: one launch less)
            tl.store(aux_ptr + i * plane + q, 0.0)
    else:
        a = tl.load(row_base(adv_ptr, q, T, adv_sb, adv_st)).to(tl.float32)
        rho = tl.exp(dh)
        a1 = a * rho
        a2 = a * clamp(rho, ratio_low, ratio_high)
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
        tl.store(aux_ptr + plane + q, (valid & (rho < ratio_low) & (a < 0)).to(tl.float32))
        tl.store(aux_ptr + 2 * plane + q, (valid & (rho > ratio_high) & (a > 0)).to(tl.float32))
        tl.store(aux_ptr + 3 * plane + q, k3)
        tl.store(aux_ptr + 4 * plane + q, logp)
    tl.store(val_ptr + q, val)
    tl.store(coef_ptr + q, coef)
    tl.store(lse_ptr + q, lse)
    return base, q, y, valid, lse, coef


@jit
def grad_row(base, g_ptr, g_sb, g_st, w_ptr, r, q, T, V, y, valid, lse, g, inv_temperature, BLOCK_V: tl.constexpr,
             STREAM: tl.constexpr, ROW_WEIGHT: tl.constexpr):
    """GRPO's gradient of logits row ``r`` (token ``q``): ``g (onehot - p) / T``, times ``w[b]`` with
    ``ROW_WEIGHT``; zeros where ignored (``STREAM``: see :func:`row_grad_store`)."""
    out_base = row_base(g_ptr, r, T, g_sb, g_st)
    if valid:
        if ROW_WEIGHT:
            g = g * tl.load(w_ptr + split_token(q, T)[0])
        row_grad_store(
            base=base, out_base=out_base, V=V, y=y, lse=lse, g=g, inv_temperature=inv_temperature,
            BLOCK_V=BLOCK_V, STREAM=STREAM)
    else:
        row_zero(out_base, V, BLOCK_V, STREAM)


@jit
def row_grad_store(base, out_base, V, y, lse, g, inv_temperature, BLOCK_V: tl.constexpr, STREAM: tl.constexpr):
    """Write ``g * (onehot(y) - exp(z - lse)) * inv_temperature`` for one row into ``out_base`` (may equal ``base``).

    ``p = 2^((x / T - lse) log2(e))``: an FFMA (``x / T - lse`` rounded once) and a multiply before the ``exp2``,
    which keeps its denormal results here (a gradient entry is not a term of a sum that holds a 1); the one-hot
    compares each column with the label in int32 (``y`` is in ``[0, V)``; another value matches no column). Whole
    blocks without masks.
    ``STREAM``: the row is read for the last time (``evict_first``) and the gradient is written with streaming
    stores (``.cs``), so that neither displaces the rows that other programs still have to read from L2."""
    cols = tl.arange(0, BLOCK_V)
    gs = g * inv_temperature
    y32 = tl.where((y >= 0) & (y < V), y, -1).to(tl.int32)
    full = V - V % BLOCK_V
    for v0 in range(0, full, BLOCK_V):
        if STREAM:
            x = tl.load(base + v0 + cols, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(base + v0 + cols).to(tl.float32)
        dz = tl.fma(-gs, tl.exp2(tl.fma(x, inv_temperature, -lse) * LOG2E), tl.where(cols == y32 - v0, gs, 0.0))
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
        dz = tl.fma(-gs, tl.exp2(tl.fma(x, inv_temperature, -lse) * LOG2E), tl.where(col == y32, gs, 0.0))
        if STREAM:
            tl.store(out_base + col, dz.to(out_base.dtype.element_ty), mask=col < V, cache_modifier=".cs")
        else:
            tl.store(out_base + col, dz.to(out_base.dtype.element_ty), mask=col < V)


@jit
def row_zero(out_base, V, BLOCK_V: tl.constexpr, STREAM: tl.constexpr = False):
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        if STREAM:
            tl.store(out_base + c, tl.zeros([BLOCK_V], dtype=out_base.dtype.element_ty), mask=c < V,
                     cache_modifier=".cs")
        else:
            tl.store(out_base + c, tl.zeros([BLOCK_V], dtype=out_base.dtype.element_ty), mask=c < V)


# ------------------------------------------------------------------ the [B, T] tails' tiles (device)
@jit
def tile_offsets(rows, T, t0, BLOCK_T: tl.constexpr):
    """Flat int64 offsets of a ``[rows, t0:t0+BLOCK_T]`` tile of a contiguous ``[B, T]`` tensor, and its t index."""
    t = t0 + tl.arange(0, BLOCK_T)
    return rows.to(tl.int64)[:, None] * T + t[None, :], t


@jit
def tile_mask(y_ptr, y_sb, y_st, rows, t, inb, ignore_index):
    """``m`` of a tile: label != ignore_index inside the bounds ``inb`` (labels may be a strided view)."""
    off = rows.to(tl.int64)[:, None] * y_sb + t.to(tl.int64)[None, :] * y_st
    return inb & (tl.load(y_ptr + off, mask=inb, other=0) != ignore_index)


@jit
def row_sums(val_ptr, aux_ptr, y_ptr, y_sb, y_st, rows, rmask, T, ignore_index, BLOCK_B: tl.constexpr,
             BLOCK_T: tl.constexpr, PARTIAL: tl.constexpr):
    """Per-row ``(sum m*val, sum m*inside, sum m)`` of the rows ``rows`` (fp32 vectors). With ``PARTIAL`` the three
    are sums of partial sums: ``val_ptr``, ``aux_ptr`` and ``y_ptr`` are planes ``[B, T]`` of per-tile sums (``T``
    tiles a row; :mod:`.fold`), read past L1 (``.cg``: other programs wrote them during this launch)."""
    s = tl.zeros([BLOCK_B], dtype=tl.float32)
    n_in = tl.zeros([BLOCK_B], dtype=tl.float32)
    n = tl.zeros([BLOCK_B], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        off, t = tile_offsets(rows, T, t0, BLOCK_T)
        inb = rmask[:, None] & (t < T)[None, :]
        if PARTIAL:
            s += tl.sum(read_partial(val_ptr + off, inb), 1)
            n_in += tl.sum(read_partial(aux_ptr + off, inb), 1)
            n += tl.sum(read_partial(y_ptr + off, inb), 1)
        else:
            m = tile_mask(y_ptr, y_sb, y_st, rows, t, inb, ignore_index)
            s += tl.sum(tl.where(m, tl.load(val_ptr + off, mask=m, other=0.0), 0.0), 1)
            n_in += tl.sum(tl.where(m, tl.load(aux_ptr + off, mask=m, other=0.0), 0.0), 1)
            n += tl.sum(m.to(tl.float32), 1)
    return s, n_in, n


@jit
def read_partial(ptr, mask):
    """Partial sums another program wrote during this launch: read from L2 (``.cg``), 0 outside ``mask``. (The
    select keeps a load from feeding a sum in a loop directly: triton 3.6's thread-locality pass rewrites that
    pattern and asserts on an accumulator with two uses after the loop, as ``_grpo_tail``'s row sums have.)"""
    return tl.where(mask, tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg"), 0.0)


@jit
def logsigmoid(x):
    # min(x, 0) - log(1 + exp(-|x|)): no overflow for either sign; NaN stays NaN
    return tl.where(x < 0, x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@jit
def frac(num, den):
    """``num / den``, 1.0 when there are no tokens (nothing was clipped)."""
    return tl.where(den > 0, num / tl.maximum(den, 1.0), 1.0)

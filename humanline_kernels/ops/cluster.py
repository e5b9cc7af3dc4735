r"""GRPO's gradient in the forward on sm_90 with each logits row held on chip by a thread-block cluster.

``gif_cluster.cu`` (beside this file) is the row kernel: CL CTAs a row, each with a slice of the row in shared
memory, the row's softmax statistics exchanged through distributed shared memory, GRPO's token terms beside them
and the gradient written from shared memory (its header has the design; its math is :mod:`.common`'s, step by
step). The logits are read once and the gradient written once: the 2-pass floor's bytes. It is built with NVRTC at
first use (:mod:`._nvrtc`: no CUDA toolkit needed; about a second a configuration) and launched through the CUDA
driver on torch's current stream.

Around it, the same launches as the Triton path's (:class:`humanline_kernels.fused._GrpoGradInForward`): the row
weights first (the weights-only finalize of :mod:`.grpo`), then the cluster kernel, which writes the gradient and
the token planes (``val``, ``coef``, ``lse``, ``aux``), then the ``[B, T]`` reduction: for a dense batch the fold's
two fixed-order levels (:mod:`.fold`'s ``tile_sums`` a program per tile, then :mod:`.grpo`'s tail on the partial
sums in the last program: the folded kernel's own device functions, in a launch of their own), for a packed batch
the finalize launch. So loss, metrics, ``w`` and ``aux`` are what the Triton path returns.

Dispatch (:func:`config`): CUDA tensors on an sm_90 device whose card, logits dtype and vocabulary size have an
entry ``[CL, threads]`` in the tuned table's ``"grad_in_forward"`` section (``tuned.json``: ``{card: {dtype: {V:
entry}}}``, :func:`.tuning.grad_in_forward_entry`; written only where a GPU run measured the cluster kernel faster
than the Triton kernel and than the default path), 16-byte aligned rows whose slice fits in shared memory. No
cluster entry is tabled until measured, so the Triton kernel (or, where tabled so, the default path) runs until
then; :func:`forced` runs a configuration regardless of the table (the benchmarks and the GPU tests).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import warnings
from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from . import _nvrtc, tuning
from ._jit import LAUNCHES, custom_op, jit, launcher
from .common import as_f32, band, device_guard, logits_rows, loss_outputs, register_budget
from .constants import Terms
from .fold import arrive, fold_config, planes, reset_counters_if_interpreted, tile_sums, workspace
from .grpo import _grpo_tail, _normalizer, _normalizer_kind, grpo_finalize
from .token_terms import _token_terms_launch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gif_cluster.cu")
ARCH = "sm_90a"
CTAS = (1, 2, 4, 8)  # CTAs a cluster (8: the portable cluster size)
THREADS = (128, 256, 512, 1024)
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the kernel's DT
SMEM_OPTIN = 232448  # shared memory a block may opt into on sm_90 (227 KiB)
STATIC_SMEM = 1024  # the kernel's static shared memory (256 B, ptxas) with room to spare
FOLD_WARPS = 4  # the reduction's programs: a 512-token tile, 4 elements a thread a plane
DEVICES = {"cuda"}  # device types the cluster path may take (the CPU tests add theirs, with a stand-in launch)


class Params(ctypes.Structure):
    """``gif_cluster.cu``'s ``Params``, field for field (the loader compiles a static_assert of every offset)."""
    _fields_ = (
        [(n, ctypes.c_void_p) for n in ("x", "g", "y", "tok", "ref", "klref", "adv", "w", "val", "coef", "lse", "aux")]
        + [(n, ctypes.c_int64) for n in ("x_sb", "x_st", "g_sb", "g_st", "y_sb", "y_st", "adv_sb", "adv_st", "plane",
                                         "Q", "ignore_index")]
        + [(n, ctypes.c_int) for n in ("T", "V", "slice", "has_tok", "clip", "has_kl_ref")]
        + [(n, ctypes.c_float) for n in ("inv_temperature", "log_eps_p", "log_eps_r", "ratio_low", "ratio_high",
                                         "beta")])


def kernel_name(dt: int, ctas: int, threads: int) -> str:
    return f"hk_gif_cluster_{dt}_{ctas}_{threads}"


def source(*configs) -> str:
    """The source of the configurations ``(dt, ctas, threads)``: ``gif_cluster.cu``, the layout checks of
    :class:`Params` against the kernel's struct, an entry point each."""
    with open(SOURCE) as f:
        text = f.read()
    # NVRTC's front end has no offsetof: there the size (with the fields' order and types, which the tests compare
    # with the struct's text, it fixes every offset), under nvcc (CI's compile test) every offset too
    checks = [f"static_assert(sizeof(Params) == {ctypes.sizeof(Params)}, \"Params: size\");", "#ifndef __CUDACC_RTC__"]
    checks += [f"static_assert(__builtin_offsetof(Params, {name}) == {getattr(Params, name).offset}, "
               f"\"Params.{name}: offset\");" for name, _ in Params._fields_]
    checks.append("#endif")
    return "\n".join([text, *checks, *(f"HK_GIF_CLUSTER({dt}, {c}, {t})" for dt, c, t in configs), ""])


def slice_elements(V: int, element_size: int, ctas: int) -> int:
    """Elements of a row each CTA holds: ``ceil(V / ctas)`` rounded up to 16 bytes (the bulk copies' unit)."""
    vec = 16 // element_size
    per = -(-V // ctas)
    return -(-per // vec) * vec


def _check_config(ctas, threads):
    if ctas not in CTAS:
        raise ValueError(f"ctas must be one of {CTAS} (CTAs a cluster), got {ctas!r}")
    if threads not in THREADS:
        raise ValueError(f"threads must be one of {THREADS}, got {threads!r}")


# ------------------------------------------------------------------------------------------- dispatch (host)


@contextlib.contextmanager
def forced(ctas: int = 4, threads: int = 256):
    """Within: GRPO's gradient in the forward runs the cluster kernel with ``ctas`` CTAs a row of ``threads``
    threads wherever it can (an sm_90 device, a row that fits), whatever the table says; a missing NVRTC raises
    instead of falling back. For the benchmarks and the GPU tests."""
    _check_config(ctas, threads)
    with tuning._forcing((ctas, threads)):  # (tuning's: a table's "default" does not send the call elsewhere)
        yield


def forced_config() -> Optional[tuple[int, int]]:
    """The configuration the innermost :func:`forced` (or ``tuning.forced_path``) forces, or None."""
    f = tuning._forced_path
    return f[-1] if f and isinstance(f[-1], tuple) else None


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def arch_ok(device: torch.device) -> bool:
    """Whether ``device`` runs the cluster kernel: a CUDA device of compute capability 9.0 (H100, H200); another
    device type only where a test put it in :data:`DEVICES`."""
    if device.type != "cuda":
        return device.type in DEVICES
    return _capability(device) == (9, 0)


def fits(logits: Tensor, grad: Optional[Tensor], ctas: int) -> bool:
    """Whether the rows of ``logits`` (and of ``grad``) suit the kernel: a dtype it has, rows a whole number of
    16-byte vectors 16 bytes apart (the bulk copies and the vector stores), a slice that fits in shared memory, at
    least one row, and a grid within the driver's 2^31 - 1 blocks. (The data pointers' own alignment is the
    launcher's to check: under torch.compile this runs on fake tensors, which have none.)"""
    if logits.dtype not in DTYPES or logits.numel() == 0:
        return False
    V, es = logits.shape[-1], logits.element_size()
    if (V * es) % 16 or not _strides_16_bytes(logits) or (grad is not None and not _strides_16_bytes(grad)):
        return False
    if slice_elements(V, es, ctas) * es + STATIC_SMEM > SMEM_OPTIN:
        return False
    return (logits.numel() // V) * ctas < 2**31


def _strides_16_bytes(t: Tensor) -> bool:
    """Whether the rows of ``t [..., V]`` are 16 bytes apart (every stride but the last, in bytes)."""
    bits = 0
    for st in t.stride()[:-1]:
        bits |= st * t.element_size()
    return bits % 16 == 0


_WARNED = []


def _nvrtc_ok() -> bool:
    """Whether NVRTC loads; if not, a warning once (the Triton kernel runs instead of a tabled cluster kernel)."""
    try:
        _nvrtc.load_nvrtc()
        return True
    except _nvrtc.NvrtcNotFound as e:
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn(f"humanline_kernels: GRPO's cluster kernel is tabled for this GPU, but {e} The Triton "
                          "kernel runs instead.", RuntimeWarning, stacklevel=3)
        return False


def config(logits: Tensor, grad: Optional[Tensor]) -> Optional[tuple[int, int]]:
    """``(ctas, threads)`` of the cluster kernel for GRPO's gradient in the forward on ``logits`` (into ``grad``,
    a buffer like them or the logits themselves), or None: the Triton kernel runs. A forced configuration
    (:func:`forced`) first, else the table's for the card, dtype and vocabulary; then the device (sm_90) and the
    rows (:func:`fits`)."""
    dev = logits.device
    if dev.type not in DEVICES:
        return None
    tabled = forced_config() is None
    cfg = tuning.grad_in_forward_entry(logits)  # (a forced configuration first; "triton" forced: none)
    cfg = cfg if isinstance(cfg, tuple) and cfg[0] in CTAS and cfg[1] in THREADS else None
    if cfg is None or not arch_ok(dev) or not fits(logits, grad, cfg[0]):
        return None
    if tabled and dev.type == "cuda" and not _nvrtc_ok():
        return None
    return cfg


# ------------------------------------------------------------------------------------------- the kernel's loader
_KERNELS: dict = {}  # (device index, dt, ctas, threads) -> _nvrtc.Function
_CUBINS: dict = {}  # (dt, ctas, threads) -> cubin (one compile a process, loaded into each device)
_LOAD = threading.Lock()


def cubin(dt: int, ctas: int, threads: int, options=()) -> tuple[bytes, str]:
    """``(cubin, NVRTC's log)`` of one configuration for sm_90a (no GPU needed)."""
    return _nvrtc.compile_cubin(source((dt, ctas, threads)), kernel_name(dt, ctas, threads), ARCH, options)


def kernel(index: int, dt: int, ctas: int, threads: int) -> _nvrtc.Function:
    """The configuration's kernel on CUDA device ``index``: compiled (once a process) and loaded at first use."""
    key = (index, dt, ctas, threads)
    fn = _KERNELS.get(key)
    if fn is None:
        with _LOAD:
            fn = _KERNELS.get(key)
            if fn is None:
                conf = (dt, ctas, threads)
                if conf not in _CUBINS:
                    _CUBINS[conf] = cubin(*conf)[0]
                name = kernel_name(*conf)
                fn = _KERNELS[key] = _nvrtc.load(_CUBINS[conf], [name], index)[name]
    return fn


def _ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


# ------------------------------------------------------------------------------------------- launchers
def _grpo_cluster_launch(logits: Tensor, labels: Tensor, ref: Tensor, kl_ref: Optional[Tensor], advantages: Tensor,
                         row_weight: Tensor, grad: Optional[Tensor], grad_inplace: bool, val: Tensor, coef: Tensor,
                         lse: Tensor, aux: Tensor, tok: Optional[Tensor], clip: bool, log_eps_p: float,
                         log_eps_r: float, ratio_low: float, ratio_high: float, beta: float, inv_temperature: float,
                         ignore_index: int, ctas: int, threads: int) -> None:
    g = logits if grad_inplace else grad
    if (logits.data_ptr() | g.data_ptr()) % 16:  # rows that do not start on 16 bytes: Triton's row kernel, which
        _token_terms_launch(                     # writes the same planes and gradient
            logits=logits, labels=labels, ref=ref, kl_ref=kl_ref, advantages=advantages, row_weight=row_weight,
            grad=grad, grad_inplace=grad_inplace, val=val, coef=coef, lse=lse, aux=aux, terms=int(Terms.GRPO),
            clip=clip, log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=ratio_low, ratio_high=ratio_high,
            beta=beta, inv_temperature=inv_temperature, ignore_index=ignore_index, n0=0 if tok is not None else
            labels.numel(), off0=0, off1=0, tok=tok)
        return
    T = labels.shape[1]
    rows, x_sb, x_st = logits_rows(logits, T)
    _, g_sb, g_st = logits_rows(g, T)
    V, es = logits.shape[-1], logits.element_size()
    dt = DTYPES[logits.dtype]
    width = slice_elements(V, es, ctas)
    p = Params(
        # data (kl_ref absent: ref, unread)
        x=logits.data_ptr(), g=g.data_ptr(), y=labels.data_ptr(), tok=_ptr(tok), ref=ref.data_ptr(),
        klref=_ptr(ref if kl_ref is None else kl_ref), adv=advantages.data_ptr(), w=row_weight.data_ptr(),
        val=val.data_ptr(), coef=coef.data_ptr(), lse=lse.data_ptr(), aux=aux.data_ptr(),
        # strides in elements (advantages [B] have a zero token stride)
        x_sb=x_sb, x_st=x_st, g_sb=g_sb, g_st=g_st, y_sb=labels.stride(0), y_st=labels.stride(1),
        adv_sb=advantages.stride(0), adv_st=advantages.stride(1) if advantages.dim() == 2 else 0,
        # shapes
        plane=aux.stride(0), Q=labels.numel(), ignore_index=ignore_index, T=T, V=V, slice=width,
        # the loss's options
        has_tok=tok is not None, clip=clip, has_kl_ref=kl_ref is not None, inv_temperature=inv_temperature,
        log_eps_p=log_eps_p, log_eps_r=log_eps_r, ratio_low=ratio_low, ratio_high=ratio_high, beta=beta)
    LAUNCHES[("compiled", "gif_cluster")] += 1
    with device_guard(logits):
        index = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
        fn = kernel(index, dt, ctas, threads)
        _nvrtc.make_current(index)
        fn.launch(ctas * rows, threads, width * es, p, torch.cuda.current_stream(logits.device).cuda_stream)


# the gradient into a buffer of its own or over the logits (as grpo.py's two ops)
_grpo_cluster_out = custom_op("grpo_cluster_out", mutates_args=("grad", "val", "coef", "lse", "aux"))(
    _grpo_cluster_launch)
_grpo_cluster_inplace = custom_op("grpo_cluster_inplace", mutates_args=("logits", "val", "coef", "lse", "aux"),
                                  bumps=("logits",))(_grpo_cluster_launch)


@jit(do_not_specialize=["B", "T", "N", "n_tiles", "aggregation", "norm_kind"])
def _grpo_fold_finalize_kernel(val_ptr, aux_ptr, y_ptr, y_sb, y_st, part_ptr, ctr_ptr, norm_ptr, loss_ptr, met_ptr,
                               w_ptr, B, T, N, n_tiles, ignore_index, aggregation, norm_kind, norm_value, dr_scale,
                               TILE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """The folded kernel's ``[B, T]`` reduction in a launch of its own, after a row kernel wrote the token planes:
    a program a tile sums it in index order (:func:`.fold.tile_sums`), counts itself in, and the last runs
    :func:`.grpo._grpo_tail` on the partial sums (the two levels of :mod:`.fold`, the same numbers)."""
    j = tl.program_id(0)
    per_row = tl.cdiv(T, TILE)
    b = j // per_row
    tile_sums(
        val_ptr=val_ptr, aux_ptr=aux_ptr, y_ptr=y_ptr, y_sb=y_sb, y_st=y_st, part_ptr=part_ptr, b=b,
        j=j - b * per_row, T=T, plane=N.to(tl.int64), n_tiles=n_tiles, ignore_index=ignore_index, AUX=4, TILE=TILE)
    if arrive(ctr_ptr, n_tiles, n_tiles):
        nt = n_tiles.to(tl.int64)
        _grpo_tail(
            val_ptr=part_ptr, aux_ptr=part_ptr + nt, y_ptr=part_ptr + 5 * nt, y_sb=0, y_st=0, norm_ptr=norm_ptr,
            loss_ptr=loss_ptr, met_ptr=met_ptr, w_ptr=w_ptr, B=B, T=per_row, N=nt, ignore_index=ignore_index,
            aggregation=aggregation, norm_kind=norm_kind, norm_value=norm_value, dr_scale=dr_scale, BLOCK_B=BLOCK_B,
            BLOCK_T=BLOCK_T, TERMS=True, PARTIAL=True)


@custom_op("grpo_fold_finalize_out", mutates_args=("loss", "met", "w"))
def _grpo_fold_finalize_out(val: Tensor, aux: Tensor, labels: Tensor, normalizer: Optional[Tensor], loss: Tensor,
                            met: Tensor, w: Tensor, aggregation: int, norm_value: float, length: int,
                            ignore_index: int) -> None:
    B, T = labels.shape
    tile, bb, bt = fold_config(val, B, FOLD_WARPS)
    n_tiles, part, ctr = workspace(val, B, T, tile, 6)
    length = length or T
    try:
        with device_guard(labels):
            launcher(_grpo_fold_finalize_kernel, labels)[(n_tiles,)](
                # data (no tensor normalizer: w, unread)
                val_ptr=val, aux_ptr=aux, y_ptr=labels, part_ptr=part, ctr_ptr=ctr,
                norm_ptr=w if normalizer is None else normalizer, loss_ptr=loss, met_ptr=met, w_ptr=w,
                # shapes
                B=B, T=T, N=aux.stride(0), n_tiles=n_tiles,
                # strides
                y_sb=labels.stride(0), y_st=labels.stride(1),
                # the loss's options
                ignore_index=ignore_index, aggregation=aggregation,
                norm_kind=int(_normalizer_kind(normalizer, norm_value)), norm_value=norm_value,
                dr_scale=1.0 / (B * length) if B * length else 0.0,
                # constants
                TILE=tile, BLOCK_B=bb, BLOCK_T=bt, num_warps=FOLD_WARPS,
                # (left to itself, triton 3.6's ptxas spilled the one-row variant for sm_80 at 32 registers)
                **register_budget(val, FOLD_WARPS))
    except BaseException:  # an interpreted launch may stop half way: its counters are not zero
        reset_counters_if_interpreted(labels)
        raise


def grpo_fold_finalize(val, aux, labels, p, inp):
    """``(loss, metrics [4], w [B])`` of GRPO from the token planes of a dense batch, as the folded kernel's."""
    loss, met, w = loss_outputs(labels, labels.shape[0], "grpo")
    normalizer, norm_value = _normalizer(p, inp)
    _grpo_fold_finalize_out(
        # data
        val=val, aux=aux, labels=labels, normalizer=normalizer, loss=loss, met=met, w=w,
        # the loss's options
        aggregation=int(p.aggregation), norm_value=norm_value, length=p.max_completion_length or 0,
        ignore_index=p.ignore_index)
    return loss, met, w


def grpo_cluster(logits, labels, ref_logps, p, inp, grad, tokens):
    """GRPO's forward with the gradient for ``grad_output = 1`` written into ``grad`` (a buffer shaped like
    ``logits``, or ``logits`` itself), on the cluster kernel: ``(aux, loss, metrics, w)`` as the Triton path of
    :class:`humanline_kernels.fused._GrpoGradInForward` has them, or None where :func:`config` chooses Triton.
    ``tokens``: a packed batch's token map (its loss and metrics then from the finalize launch)."""
    cfg = config(logits, None if grad is logits else grad)
    if cfg is None:
        return None
    B, T = labels.shape
    row_weight = grpo_finalize(None, None, labels, p, inp)[2]  # w[b] from the labels, before the rows
    val, coef, lse, aux = planes(B, T, 5, logits)
    inplace = grad is logits
    (_grpo_cluster_inplace if inplace else _grpo_cluster_out)(
        # data
        logits=logits, labels=labels, ref=as_f32(ref_logps), kl_ref=as_f32(inp.kl_ref_logps),
        advantages=inp.advantages.to(torch.float32), row_weight=row_weight, grad=None if inplace else grad,
        grad_inplace=inplace, val=val, coef=coef, lse=lse, aux=aux, tok=tokens,
        # the loss's options
        **band(p.clip), ratio_low=1.0 - float(p.epsilon_low), ratio_high=1.0 + float(p.epsilon_high),
        beta=float(p.beta), inv_temperature=1.0 / float(p.temperature), ignore_index=p.ignore_index,
        # the configuration
        ctas=cfg[0], threads=cfg[1])
    if tokens is None:
        loss, met, w = grpo_fold_finalize(val, aux, labels, p, inp)
    else:
        loss, met, w = grpo_finalize(val, aux, labels, p, inp)
    return aux, loss, met, w

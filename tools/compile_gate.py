"""Ahead-of-time compile of every Triton launch the package can make, for one GPU architecture, without a GPU.

``python tools/compile_gate.py --arch 90 [--json FILE]`` (run by ``tests/ops/test_compile_gate.py`` in a subprocess:
it installs a stand-in Triton driver, which must not leak into the test process).

How: the real launch wrappers of :mod:`humanline_kernels.ops` are called on ``meta`` tensors (no memory, any
size) with ``meta`` routed to the compiled kernels. Triton's own ``JITFunction.run`` then specialises each launch
exactly as at run time (dtypes, 16-divisibility of pointers and integers, integers equal to 1, int32 vs int64)
and compiles it for ``GPUTarget("cuda", arch, 32)`` with the ptxas inside the triton wheel; the launch itself is
skipped (``warmup=True``). The cases cover every constexpr combination (loss mode, clip, kl_ref, gradient in the
forward, in place, entropy, loss backward, finalize) at one aligned shape for fp32/bf16/fp16 logits, and every
specialisation-changing shape (rows not 16-byte aligned, batch/row strides past 2^31, T = 1, odd T, tiny V, a
``[:, :-1]`` view) for the main configurations, and the fused-linear driver of each loss (one chunk and split
chunks). Each compiled variant is then checked in the ``ptxas -v`` log of Triton's own build (no spills, no stack
frame) and in its PTX (no local memory; 16-byte global loads in aligned variants, except the finalize kernels, which
stream no row).

Prints one JSON object: ``{"arch", "variants": [...], "failures": [...], "kernels": [...], "digests": {...}}``; each
variant and each case's kernels carry a digest of their PTX (:func:`ptx_digest`), so two runs show whether a change
left the compiled programs as they were.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback

os.environ["TRITON_INTERPRET"] = "0"
# Triton runs ptxas -v on every kernel it builds; this prints that log, which the gate reads (see _resources)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from tools/
from tools.stand_in_driver import StandInDriver  # noqa: E402  (a target, device 0, stream 0; never launches here)

SHAPES = {  # name -> (logits shape allocated, slice of T or None, 16-byte aligned rows)
    "aligned": ((2, 8, 32000), None, True),
    "view[:, :-1]": ((2, 9, 32000), slice(0, -1), True),
    "V=50257": ((2, 8, 50257), None, False),
    "T*V>2^31": ((2, 16384, 151936), None, True),
    "T=1": ((4, 1, 32000), None, True),
    "odd T, tiny V": ((3, 7, 5), None, False),
    "one row": ((1, 8, 32000), None, True),  # the finalize kernels' 1 x 4 block_t tiles (see below)
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# GRPO's gradient in the forward in the folded kernel (its GRAD modes: none, on the persistent grid with each row's
# weight or the shared one; the gradient new or over the logits)
GIF_VARIANTS = ("none", "persistent rows new", "persistent shared new", "persistent shared inplace")


# the compiler options a launch of ours states instead of leaving them to Triton's defaults
_OPTIONS = ("enable_fp_fusion", "num_warps")

PTXAS_LOGS = {}  # id(compiled kernel) -> the ptxas -v log of Triton's own build of it (the kernels stay alive)


_OTHER_SHARD = [False]


def _install(arch, compiled, launches=None):
    """Compile instead of launching; ``launches`` (a list) records every launch's ``(kernel, kwargs, grid)``."""
    from triton.runtime import driver

    driver.set_active(StandInDriver(arch))
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):  # compile as at run time, never launch
        if launches is not None:
            launches.append((self, kwargs, grid))
        if _OTHER_SHARD[0]:  # another shard compiles this case: only its launches are recorded (for the derived)
            return None
        with contextlib.redirect_stdout(io.StringIO()) as log:  # the ptxas log of a kernel built now
            kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        if _REGS.search(log.getvalue()):
            PTXAS_LOGS.setdefault(id(kernel), log.getvalue())
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = run
    from humanline_kernels.ops import _jit
    _jit.COMPILED_DEVICES.add("meta")


def _cases():
    """``(name, aligned, call)``: each call drives the real launch wrappers once."""
    from humanline_kernels import HumanlineClip
    from humanline_kernels import _params as P
    from humanline_kernels.ops import kernels as FK
    from humanline_kernels.ops import logprobs as LPK
    from humanline_kernels.ops import token_terms as TK
    from humanline_kernels.ops.constants import Terms

    clip = HumanlineClip(-1.5, 1.5)

    def tensors(shape_name, dtype):
        shape, tslice, aligned = SHAPES[shape_name]
        x = torch.empty(shape, dtype=dtype, device="meta")
        if tslice is not None:
            x = x[:, tslice]
        B, T, V = x.shape
        y = torch.empty((B, T), dtype=torch.int64, device="meta")
        f = torch.empty((B, T), dtype=torch.float32, device="meta")
        adv = torch.empty((B,), dtype=torch.float32, device="meta")
        return x, y, f, adv, aligned

    def terms(shape_name, dtype, mode, use_clip, kl_ref, grad, adv_per_token=False):
        x, y, f, adv, _ = tensors(shape_name, dtype)
        c = clip if use_clip else None
        if mode == Terms.GRPO:
            p = P.GRPO(clip=c, beta=0.04, temperature=0.7)
            inp = P.GRPOInputs(f if adv_per_token else adv, f if kl_ref else None)
            kw = {}
            if grad:
                kw = dict(row_weight=adv, grad_out=x if grad == "inplace" else torch.empty_like(x))
            TK.token_terms(x, y, f, p, inp, **kw)
        else:
            TK.token_terms(x, y, f, P.DPO(clip=c, temperature=0.7))

    def fwd(shape_name, dtype, entropy):
        x, y, *_ = tensors(shape_name, dtype)
        LPK.logprobs_fwd(x, y, 0.7, -100, entropy)

    def bwd(shape_name, dtype, inplace, entropy=False):
        x, y, f, *_ = tensors(shape_name, dtype)
        LPK.logprobs_bwd(x, y, f, f, 0.7, -100, out=x if inplace else None, grad_entropy=f if entropy else None,
                         entropy=f if entropy else None)

    def loss_bwd(shape_name, dtype, inplace):
        x, y, f, adv, _ = tensors(shape_name, dtype)
        LPK.logprobs_bwd(x, y, f, f, 0.7, -100, out=x if inplace else None, row_weight=adv,
                         grad_loss=torch.empty((), dtype=torch.float32, device="meta"))

    def linear(kind, dtype, split):
        # the fused-linear paths as they run (public functions, their chunk loops): each chunk's logits in an
        # [n, V] buffer addressed through its token ranges, outputs written into whole-batch buffers; GRPO chunks
        # of whole rows or of tokens (split), DPO chunks of all pairs (one range) or of some (two ranges), KTO chunks
        # of rows; plain log-probs forward and (recomputing) backward
        B, T, V, D = 4, 16, 32000, 64
        h = torch.empty((B, T, D), dtype=dtype, device="meta", requires_grad=True)
        w = torch.empty((V, D), dtype=dtype, device="meta", requires_grad=True)
        y = torch.empty((B, T), dtype=torch.int64, device="meta")
        f = torch.empty((B, T), dtype=torch.float32, device="meta")
        rows = {"grpo": 12 if split else 2 * T, "dpo": 2 * T if split else B * T, "kto": T if split else B * T,
                "token_logprobs": 12 if split else B * T, "sequence": 12 if split else B * T}[kind]
        run_linear(kind, B, h, w, y, f, kl_rows=True, chunk_bytes=rows * V * h.element_size(), validate=False)

    def run_linear(kind, B, h, w, y, f, kl_rows, **kw):
        # one fused-linear call of `kind` over B rows or sequences, forward and backward (KTO with or without its
        # KL rows)
        import humanline_kernels as hk
        if kind == "grpo":
            hk.fused_linear.grpo(h, w, y, f, torch.empty((B,), dtype=torch.float32, device="meta"), beta=0.04, **kw)
        elif kind == "dpo":
            hk.fused_linear.dpo(h, w, y, f, **kw)
        elif kind == "kto":
            des = torch.empty((B,), dtype=torch.bool, device="meta")
            if kl_rows:
                kl = torch.empty((B, 3), dtype=torch.float32, device="meta")
                hk.fused_linear.kto(h, w, y, f, des, kl, kl, torch.empty((B, 3), dtype=torch.bool, device="meta"),
                                    **kw)
            else:
                hk.fused_linear.kto(h, w, y, f, des, **kw)
        elif kind == "sequence":
            s, pol, _ = hk.fused_linear.sequence_logratios(h, w, y, f, clip=clip, **kw)
            torch.autograd.grad((s.sum(), pol.sum()), (h, w))
        else:
            lp, ent = hk.fused_linear.token_logprobs(h, w, y, return_entropy=True, **kw)
            torch.autograd.grad((lp, ent), (h, w), (torch.empty_like(lp), torch.empty_like(ent)))

    def layout(level, kind, dtype, mode):
        # a token map in the row kernels (has_tok): a packed batch at the logits level (logits [N, V] rows to
        # the padded planes), and the fused-linear chunks of a packed batch or of the supervised tokens only
        # (gathered hidden rows, chunk slices of the map), forward and backward
        import humanline_kernels as hk
        B, T, V, D = 4, 16, 32000, 64
        lens = [16, 9, 12, 5]
        cu = [0, 16, 25, 37, 42]
        N = cu[-1] if mode != "supervised" else B * T
        extra = dict(validate=False)
        if mode != "supervised":
            extra["packed"] = hk.Packed(cu)
        if mode != "packed":
            extra["supervised"] = [[3, n] for n in lens]
        shape = (N,) if mode != "supervised" else (B, T)
        y = torch.empty(shape, dtype=torch.int64, device="meta")
        f = torch.empty(shape, dtype=torch.float32, device="meta")
        adv = torch.empty((B,), dtype=torch.float32, device="meta")
        if level == "fused":
            x = torch.empty((N, V), dtype=dtype, device="meta", requires_grad=True)
            extra.pop("supervised", None)
            if kind == "grpo":
                for gif in (False, True):
                    loss = hk.fused.grpo(x, y, f, adv, beta=0.04, grad_in_forward=gif, **extra)[0]
                    torch.autograd.grad(loss, x)
            elif kind == "dpo":
                torch.autograd.grad(hk.fused.dpo(x, y, f, **extra)[0], x)
            else:
                s, pol, _ = hk.fused.sequence_logratios(x, y, f, clip=clip, **extra)
                torch.autograd.grad((s.sum(), pol.sum()), x)
            return
        h = torch.empty((*shape, D), dtype=dtype, device="meta", requires_grad=True)
        w = torch.empty((V, D), dtype=dtype, device="meta", requires_grad=True)
        run_linear(kind, B, h, w, y, f, kl_rows=False, chunk_bytes=12 * V * h.element_size(), **extra)

    def kto_inputs(f, adv, variant):
        # KTO's baseline from KL rows ("kl_rows"), given ("z0"), or none
        des = torch.empty(adv.shape, dtype=torch.bool, device="meta")
        kl = (f[:, :3], f[:, :3], torch.empty((f.shape[0], 3), dtype=torch.bool, device="meta"))
        return P.KTOInputs(des, *(kl if variant == "kl_rows" else (None,) * 3), adv[0] if variant == "z0" else None)

    def finalize(shape_name, kind, variant, labels_view=True):
        x, y, f, adv, _ = tensors(shape_name, torch.bfloat16)
        if labels_view:  # a labels[:, 1:] view (unaligned) as well as contiguous labels: separate specialisations
            y = torch.empty((y.shape[0], y.shape[1] + 1), dtype=torch.int64, device="meta")[:, 1:]
        aux = torch.empty((5 if kind in ("grpo", "fold") else 4, *f.shape), dtype=torch.float32, device="meta")
        if kind == "dpo":
            FK.dpo_finalize(f, aux, y, P.DPO())
        elif kind == "sequence":
            FK.seq_finalize(f, aux, y, P.Sequence(), f if variant == "weights" else None)
        elif kind == "kto":
            inp = kto_inputs(f, adv, variant)
            FK.kto_finalize(f, aux, y, P.KTO(clip=clip), inp)
        else:
            norm = torch.empty((), dtype=torch.float32, device="meta") if variant == "norm_tensor" else None
            inp = P.GRPOInputs(adv, None, norm)
            if kind == "fold":  # the folded reduction in a launch of its own, after the cluster kernel (ops/cluster.py)
                from humanline_kernels.ops import cluster
                cluster.grpo_fold_finalize(f, aux, y, P.GRPO(loss_type="grpo"), inp)
            else:
                FK.grpo_finalize(None if variant == "weights" else f, aux, y, P.GRPO(loss_type="grpo"), inp)

    def sequence(shape_name, dtype, weights):
        # the sequence-level primitive through its public function: row kernel, sums kernel (with or without token
        # weights), and the backward with both row weights
        import humanline_kernels as hk
        x, y, f, *_ = tensors(shape_name, dtype)
        x.requires_grad_()
        tw = torch.empty(f.shape, dtype=torch.float32, device="meta") if weights else None
        from humanline_kernels import fused as F
        from humanline_kernels._params import Sequence
        s, pol, _n, _m = F._Sequences.apply(Sequence(clip=clip), False, None, x, y, f, tw)
        torch.autograd.grad((s.sum(), pol.sum()), x)
        hk.fused.sequence_logratios(x, y, f, clip=None, validate=False)

    def fold(shape_name, dtype, kind, variant, use_clip=True, kl_ref=False):
        # a fused loss's forward in one launch, the finalize folded into the row kernel (ops/fold.py);
        # GRPO's gradient in the forward on the persistent grid, with each row's weight ("rows") or the shared one
        # ("shared"), into a new buffer or over the logits ("inplace")
        x, y, f, adv, _ = tensors(shape_name, dtype)
        c = clip if use_clip else None
        if kind == "dpo":
            FK.dpo_loss(x, y, f, P.DPO(clip=c, temperature=0.7))
        elif kind == "kto":
            inp = kto_inputs(f, adv, variant)
            FK.kto_loss(x, y, f, P.KTO(clip=c), inp)
        else:
            grad = None if variant == "none" else x if variant.endswith("inplace") else torch.empty_like(x)
            p = P.GRPO(clip=c, beta=0.04, temperature=0.7)
            FK.grpo_loss(x, y, f, p, P.GRPOInputs(adv, f if kl_ref else None), grad_out=grad,
                           row_weight=None if "shared" in variant else adv)

    def scale(shape_name, dtype):
        x, *_ = tensors(shape_name, dtype)
        LPK.scale_rows_(x, torch.empty((), dtype=torch.float32, device="meta"))

    def scaled(shape, dtype):
        # the fused-linear backward: the fp32 dW [V, D] / db [V] accumulator times grad_output, into the weight dtype
        LPK.scaled(torch.empty(shape, dtype=torch.float32, device="meta"),
                   torch.empty((), dtype=torch.float32, device="meta"), dtype)

    cases = []
    for dn, dt in DTYPES.items():
        # every constexpr combination at the aligned shape
        for use_clip in (False, True):
            cases.append((f"terms mode=1 clip={use_clip} {dn} aligned", SHAPES["aligned"][2],
                          lambda dt=dt, c=use_clip: terms("aligned", dt, 1, c, False, None)))
        for use_clip, kl_ref, grad in itertools.product((False, True), (False, True), (None, "new", "inplace")):
            cases.append((f"terms mode=2 clip={use_clip} kl_ref={kl_ref} grad={grad} {dn} aligned", True,
                          lambda dt=dt, c=use_clip, k=kl_ref, g=grad: terms("aligned", dt, 2, c, k, g)))
        cases.append((f"terms mode=2 advantages [B, T] {dn} aligned", True,
                      lambda dt=dt: terms("aligned", dt, 2, True, False, "new", True)))
        for ent in (False, True):
            cases.append((f"logprobs_fwd entropy={ent} {dn} aligned", True, lambda dt=dt, e=ent: fwd("aligned", dt, e)))
        for inplace, entropy in itertools.product((False, True), (False, True)):
            cases.append((f"logprobs_bwd inplace={inplace} entropy={entropy} {dn} aligned", True,
                          lambda dt=dt, i=inplace, e=entropy: bwd("aligned", dt, i, e)))
        cases.append((f"scale_rows {dn} aligned", True, lambda dt=dt: scale("aligned", dt)))
        for what, shape, aligned in (("dW", (32000, 4096), True), ("db", (32000,), True),
                                     ("db V=50257", (50257,), False)):
            cases.append((f"scaled {what} fp32->{dn}", aligned, lambda dt=dt, sh=shape: scaled(sh, dt)))
        for weights in (False, True):
            cases.append((f"sequence weights={weights} {dn} aligned", True,
                          lambda dt=dt, wt=weights: sequence("aligned", dt, wt)))
        for inplace in (False, True):
            cases.append((f"loss_bwd inplace={inplace} {dn} aligned", True,
                          lambda dt=dt, i=inplace: loss_bwd("aligned", dt, i)))
        for use_clip in (False, True):
            cases.append((f"fold dpo clip={use_clip} {dn} aligned", True,
                          lambda dt=dt, c=use_clip: fold("aligned", dt, "dpo", "", c)))
            for variant in ("", "kl_rows", "z0"):
                cases.append((f"fold kto {variant} clip={use_clip} {dn} aligned", True,
                              lambda dt=dt, c=use_clip, v=variant: fold("aligned", dt, "kto", v, c)))
        for use_clip, kl_ref, variant in itertools.product((False, True), (False, True), GIF_VARIANTS):
            cases.append((f"fold grpo {variant} clip={use_clip} kl_ref={kl_ref} {dn} aligned", True,
                          lambda dt=dt, c=use_clip, k=kl_ref, v=variant: fold("aligned", dt, "grpo", v, c, k)))
        # every specialisation-changing shape, main configurations
        for sn, (_shape, _sl, aligned) in SHAPES.items():
            if sn in ("aligned", "one row"):
                continue
            cases += [
                (f"terms mode=1 clip=True {dn} {sn}", aligned, lambda dt=dt, s=sn: terms(s, dt, 1, True, False, None)),
                (f"terms mode=2 clip=True kl_ref=True grad=new {dn} {sn}", aligned,
                 lambda dt=dt, s=sn: terms(s, dt, 2, True, True, "new")),
                (f"terms mode=2 clip=False kl_ref=False grad=inplace {dn} {sn}", aligned,
                 lambda dt=dt, s=sn: terms(s, dt, 2, False, False, "inplace")),
                (f"logprobs_fwd entropy=True {dn} {sn}", aligned, lambda dt=dt, s=sn: fwd(s, dt, True)),
                (f"logprobs_bwd inplace=False {dn} {sn}", aligned, lambda dt=dt, s=sn: bwd(s, dt, False)),
                (f"scale_rows {dn} {sn}", aligned, lambda dt=dt, s=sn: scale(s, dt)),
            ]
            # (fp16: its switch combinations at the aligned shape only; it compiles as bf16 but for the conversions,
            # and the fold's variants are the gate's most expensive compiles)
            cases += [(f"fold {kind} {variant} {dn} {sn}", aligned, lambda dt=dt, s=sn, k=kind, v=variant:
                       fold(s, dt, k, v)) for kind, variant in (("dpo", ""), ("kto", "kl_rows"), ("grpo", "none"),
                                                                ("grpo", "persistent shared new"),
                                                                ("grpo", "persistent rows inplace"))
                      if dn != "fp16"]
            if dn == "bf16":  # the loss backward is the bwd kernel plus three scalar loads: one dtype suffices
                cases.append((f"loss_bwd inplace=False {dn} {sn}", aligned, lambda dt=dt, s=sn: loss_bwd(s, dt, False)))
    for dn in ("bf16", "fp32"):
        for kind, split in itertools.product(("grpo", "dpo", "kto", "token_logprobs", "sequence"), (False, True)):
            cases.append((f"fused_linear {kind} split={split} {dn}", True,
                          lambda dt=DTYPES[dn], k=kind, sp=split: linear(k, dt, sp)))
        for kind in ("grpo", "dpo", "sequence"):
            cases.append((f"layout fused {kind} packed {dn}", True, lambda dt=DTYPES[dn], k=kind:
                          layout("fused", k, dt, "packed")))
        for kind, mode in itertools.product(("grpo", "dpo", "kto", "token_logprobs", "sequence"),
                                            ("packed", "supervised", "packed+supervised")):
            if kind == "token_logprobs" and mode == "packed":
                continue  # (plain log-probs have no sequences: a packed batch is just tokens)
            cases.append((f"layout fused_linear {kind} {mode} {dn}", True,
                          lambda dt=DTYPES[dn], k=kind, m=mode: layout("fused_linear", k, dt, m)))
    # the [B, T] tail: one program over small fp32 tensors, not a row-streaming kernel, so no 16-byte load rule
    # (B and T are not specialised: the shapes below only change the pointers' and strides' specialisation)
    # (tiles follow the rows a program walks: 1 x 4 block_t for one row or DPO pair, 2 x 2 block_t for two, else 4 x
    # block_t; "aligned" has one DPO pair and two rows, "T=1" four, "one row" one)
    for sn in ("aligned", "T=1", "odd T, tiny V", "one row"):
        for kind, variant in (("dpo", ""), ("kto", ""), ("kto", "kl_rows"), ("kto", "z0"), ("grpo", ""),
                              ("grpo", "weights"), ("grpo", "norm_tensor"), ("sequence", ""), ("sequence", "weights")):
            if sn == "one row" and kind == "dpo":
                continue  # (pairs need two rows)
            cases.append((f"finalize {kind} {variant} {sn}", False, lambda s=sn, k=kind, v=variant: finalize(s, k, v)))
            if kind == "grpo" and variant != "weights":
                cases.append((f"fold finalize grpo {variant} {sn}", False,
                              lambda s=sn, v=variant: finalize(s, "fold", v)))
            if sn == "aligned":
                cases.append((f"finalize {kind} {variant} {sn} contiguous labels", False,
                              lambda s=sn, k=kind, v=variant: finalize(s, k, v, False)))
    # every configuration of the committed tuning table (humanline_kernels/ops/tuning.py), forced on its family's
    # kernels in the aligned shape and the entry's dtype: a tuned launch is spill-free before it lands (the switch
    # combinations derived from these launches go back to the default blocks where a launch rule derives them)
    from humanline_kernels.ops import tuning
    dtypes = {v: k for k, v in tuning.DTYPES.items()}

    def tuned_calls(family, dt):
        return {
            "fwd": (lambda: fwd("aligned", dt, False), lambda: fwd("aligned", dt, True)),
            "terms": (lambda: terms("aligned", dt, 1, True, False, None),
                      lambda: terms("aligned", dt, Terms.GRPO, True, True, "new"),
                      lambda: fold("aligned", dt, "dpo", ""), lambda: fold("aligned", dt, "kto", "kl_rows"),
                      lambda: fold("aligned", dt, "grpo", "none")),
            "bwd": (lambda: bwd("aligned", dt, False), lambda: bwd("aligned", dt, True, True),
                    lambda: loss_bwd("aligned", dt, False), lambda: scale("aligned", dt)),
            "gif": tuple(lambda v=v: fold("aligned", dt, "grpo", v, True, True) for v in GIF_VARIANTS[1:]),
        }[family]
    for family, dn, block, warps in tuning.entries():
        for i in range(len(tuned_calls(family, None))):
            cases.append((f"tuned {family} {dn} BLOCK_V={block} warps={warps} #{i}", True,
                          lambda f=family, d=dtypes[dn], b=block, w=warps, i=i: _tuned(f, b, w,
                                                                                       tuned_calls(f, d)[i])))
    return cases


def _tuned(family, block, warps, call):
    from humanline_kernels.ops import tuning
    with tuning.forced(family, block, warps):
        call()


_LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
_STRIDE = re.compile(r"_s[bt]$|stride")  # strides: the shape cases above cover their specialisations


def _int_class(v):
    """What Triton specialises an integer argument on: equal to 1, divisible by 16, or neither."""
    return "1" if v == 1 else "16" if v % 16 == 0 else "n"


def _launch_rules():
    """Launch parameters a launcher derives from a kernel's switches: a derived combination gets them by the
    launcher's own rule (kernel name -> kwargs -> kwargs), not the recorded launch's."""
    from humanline_kernels.ops import fold, grpo

    def grpo_fold(kw):  # the persistent grid (GRAD 2, 3) has its own block, warps and register budget, and the
        x = kw["x_ptr"]  # tail's tiles follow the warps
        block, warps = grpo.grpo_config(x, kw["GRAD"])
        _tile, bb, bt = fold.fold_config(x, kw["B"], warps)
        kw = {k: v for k, v in kw.items() if k != "maxnreg"}
        return dict(kw, BLOCK_V=block, BLOCK_B=bb, BLOCK_T=bt, num_warps=warps,
                    **grpo.grpo_register_budget(x, warps, kw["GRAD"]))
    return {"_grpo_loss_kernel": grpo_fold}


# fewer bases for the folded kernels (ops/fold.py): each compile is a row kernel and a loss tail, and their
# listed cases already cover every switch combination at the aligned shape in each dtype
_MAX_BASES = {"_grpo_loss_kernel": 3, "_dpo_loss_kernel": 3, "_kto_loss_kernel": 3}


def derived_variants(launches, max_bases):
    """Every combination of each kernel's switches, derived from the kernel and its recorded launches, not from a
    list: the constexpr parameters that take booleans or small values (not the ``BLOCK_*`` sizes) and the runtime
    integers the kernel specialises that only ever carry small values (enums and flags: Triton compiles a value of
    1 as a constant, so ``aggregation=1`` and ``aggregation=0`` are different programs). Each kernel's combinations are
    applied to up to ``max_bases`` of its recorded launches with distinct pointer dtypes and integer classes.
    ``launches``: ``[(kernel, kwargs, grid, aligned)]``; returns ``[(name, kernel, kwargs, grid, aligned)]``."""
    by_kernel = {}
    for kernel, kwargs, grid, aligned in launches:
        by_kernel.setdefault(id(kernel), (kernel, []))[1].append((kwargs, grid, aligned))
    out = []
    for kernel, calls in by_kernel.values():
        params = {p.name: p for p in kernel.params}
        values = {}
        for kwargs, _, _ in calls:
            for k, v in kwargs.items():
                values.setdefault(k, set()).add(v if isinstance(v, (bool, int, float, str)) else None)
        switches = {}
        for name, p in params.items():
            seen = values.get(name, set())
            if p.is_constexpr and not name.startswith("BLOCK") and seen and all(
                    isinstance(v, bool) or (isinstance(v, int) and 0 <= v < 8) for v in seen):
                switches[name] = sorted(seen | ({False, True} if all(isinstance(v, bool) for v in seen) else set()))
            elif (not p.is_constexpr and not p.do_not_specialize and seen and not _STRIDE.search(name)
                  and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 4 for v in seen)):
                # an enum or a flag: one value of each class Triton specialises on (divisible by 16, 1, neither)
                switches[name] = sorted(seen | {0, 1, 2})
        bases, keys = [], set()
        for kwargs, grid, aligned in calls:
            key = (aligned, *sorted((k, str(v.dtype) if isinstance(v, torch.Tensor) else
                                _int_class(v) if isinstance(v, int) and not isinstance(v, bool) else None)
                               for k, v in kwargs.items() if k not in switches and k not in _LAUNCH_OPTIONS))
            if key not in keys and len(bases) < min(max_bases, _MAX_BASES.get(kernel.fn.__name__, max_bases)):
                keys.add(key)
                bases.append((kwargs, grid, aligned))
        names = sorted(switches)
        rule = _launch_rules().get(kernel.fn.__name__, lambda kw: kw)
        # the "neither" class (2) of a runtime integer that no launch passed is compiled on the first base only: it
        # differs from 0 by a divisibility hint alone, and with triton 3.9 for sm_90 none of its 326 compiles on
        # every base gave PTX that no other case had (they took 111 s of the gate's 360 on one core)
        rare = {n: {2} - values[n] for n in names if not params[n].is_constexpr}
        for b, (kwargs, grid, aligned) in enumerate(bases):
            for combo in itertools.product(*(switches[n] for n in names)):
                if b and any(v in rare.get(n, ()) for n, v in zip(names, combo)):
                    continue
                label = ", ".join(f"{n}={v}" for n, v in zip(names, combo))
                out.append((f"derived {kernel.fn.__name__}({label})", kernel,
                            rule(dict(kwargs, **dict(zip(names, combo)))), grid, aligned))
    return out


def _all_kernels():
    """Names of every ``@jit`` function in ``humanline_kernels.ops`` that no other one calls (the launchable ones)."""
    import importlib
    import pkgutil

    import humanline_kernels.ops as pkg
    fns = {}
    for m in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + "."):
        mod = importlib.import_module(m.name)
        fns.update({v.fn.__name__: v for v in vars(mod).values() if isinstance(v, JITFunction)})
    called = {n for f in fns.values() for n in f.fn.__code__.co_names if n in fns}
    return sorted(set(fns) - called)


_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _resources(kernel, arch):
    """``(registers, stack, spill stores, spill loads)`` from ``ptxas -v``: the log of Triton's own ptxas run (its
    flags, e.g. ``--regAllocOptLevel=2`` with triton 3.9), or a second ptxas run on the PTX for a kernel whose
    build printed none (read from Triton's cache)."""
    text = PTXAS_LOGS.get(id(kernel))
    if text is None:
        print(f"no ptxas log for {kernel.name}: running ptxas again", file=sys.stderr)
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch) if get_ptxas.__code__.co_argcount else get_ptxas()
        path = ptxas.path if hasattr(ptxas, "path") else ptxas[0]
        ptx = kernel.asm["ptx"]
        target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)  # sm_90a on Hopper: what Triton built
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            out = subprocess.run([path, "-v", f"--gpu-name={target}", src, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True, check=True)
        text = out.stdout + out.stderr
    return (int(_REGS.search(text).group(1)), *(int(g) for g in _FRAME.search(text).groups()))


_DEBUG_LABEL = re.compile(r"\$L__(?:tmp|func_begin|func_end)\d+:")


def ptx_digest(ptx, name):
    """SHA-256 of the PTX less what does not reach the GPU: the debug sections and line records (``.file``,
    ``.loc``, their labels), comments, and the kernel's own name. Equal digests are the same program, wherever its
    source lives and whatever its functions are called, so a refactor can show that it left the kernels as they
    were."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    lines = []
    for line in code.splitlines():
        line = line.split("//", 1)[0].rstrip()
        word = line.strip()
        if not word or word.startswith((".loc", ".file")) or _DEBUG_LABEL.fullmatch(word):
            continue
        lines.append(line)
    return hashlib.sha256(re.sub(rf"\b{re.escape(name)}\b", "KERNEL", "\n".join(lines)).encode()).hexdigest()[:16]


def _vector_loads(ptx):
    """16-byte global loads (``ld.global...v4.b32`` / ``.v4.f32`` / ``.v2.b64``) in the PTX."""
    return len(re.findall(r"ld\.global[.:\w]*\.v(?:4\.(?:b|f|u)32|2\.(?:b|f|u)64)", ptx))  # (hints: L2::...)


def _compile(name, call, compiled, failures):
    """Run one case's launches through the compiler; a compile error is recorded, so one run lists every failure."""
    compiled.clear()
    try:
        call()
    except Exception as e:
        failures.append({"case": name, "error": f"{type(e).__name__}: {str(e)[-600:]}",
                         "trace": traceback.format_exc()[-1500:]})
        return []
    return list(compiled)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--arch", type=int, required=True)
    p.add_argument("--only", default=None, help="substring of the case names to run")
    p.add_argument("--no-derived", action="store_true", help="only the listed cases, not every switch combination")
    p.add_argument("--bases", type=int, default=6, help="the derived combinations on up to this many recorded "
                   "launches a kernel (distinct pointer dtypes and integer classes)")
    p.add_argument("--shard", default="0/1", help="I/K: compile the I-th of K shares of the cases and derived "
                   "variants (every shard records every case's launches, so all derive the same variants)")
    p.add_argument("--record-only", action="store_true", help="compile nothing: print each case's launches "
                   "(kernel and the launch options it states) as {\"launches\": [...]}")
    a = p.parse_args(argv)
    shard, shards = (int(x) for x in a.shard.split("/"))
    compiled, launches = [], []
    _install(a.arch, compiled, launches)
    failures, results, recorded = [], [], []  # results: (case, aligned, kernel name, compiled kernel)
    for j, (name, aligned, call) in enumerate(_cases()):
        if a.only and a.only not in name:
            continue
        launches.clear()
        _OTHER_SHARD[0] = a.record_only or j % shards != shard
        out = _compile(name, call, compiled, [] if _OTHER_SHARD[0] else failures)
        results += [(name, aligned, kname, k) for kname, k in out]
        recorded += [(k, kw, g, aligned) for k, kw, g in launches]
        for k, kw, _ in launches:  # a Triton upgrade must not change a result unseen (its defaults move)
            if "enable_fp_fusion" not in kw and not _OTHER_SHARD[0]:
                failures.append({"case": name, "kernel": k.fn.__name__,
                                 "error": "the launch leaves enable_fp_fusion to Triton's default"})
    _OTHER_SHARD[0] = False
    if a.record_only:
        print(json.dumps({"launches": [{"kernel": k.fn.__name__, "options": {o: kw[o] for o in _OPTIONS if o in kw}}
                                       for k, kw, _, _ in recorded], "kernels": _all_kernels()}))
        return 0
    # then every combination of each kernel's switches on its recorded launches: a combination no listed case
    # reaches still compiles on the GPU the day a user reaches it
    derived = [] if a.no_derived else derived_variants(recorded, a.bases)
    for name, kernel, kwargs, grid, aligned in derived[shard::shards]:
        out = _compile(name, lambda k=kernel, kw=kwargs, g=grid: k[g](**kw), compiled, failures)
        results += [(name, aligned, kname, k) for kname, k in out]
    variants, seen = [], set()
    # every case's compiled kernels by PTX digest, repeats included (what a refactor compares, case by case)
    digests = {}
    for name, _aligned, kname, kernel in results:
        digests.setdefault(name, []).append([kname, ptx_digest(kernel.asm["ptx"], kernel.name)])
    for name, aligned, kname, kernel in results:
        ptx = kernel.asm["ptx"]
        key = (kname, hash(ptx))
        if key in seen:
            continue
        seen.add(key)
        regs, stack, spill_st, spill_ld = _resources(kernel, a.arch)
        # the finalize kernels (one program over small [B, T] tensors) stream no row: no 16-byte load rule
        v = {"case": name, "kernel": kname, "ptx_digest": ptx_digest(ptx, kernel.name), "registers": regs,
             "stack": stack, "spill_stores": spill_st, "spill_loads": spill_ld, "local_in_ptx": ".local" in ptx,
             "vector_loads": _vector_loads(ptx),
             "aligned": aligned and not kname.endswith("_finalize_kernel")}
        variants.append(v)
        problems = []
        if stack or spill_st or spill_ld or v["local_in_ptx"]:
            problems.append("spills / local memory")
        # every aligned variant of a kernel that streams a row must use 16-byte loads
        if v["aligned"] and not v["vector_loads"]:
            problems.append("no 16-byte global loads in an aligned variant")
        if problems:
            failures.append({"case": name, "kernel": kname, "error": "; ".join(problems), "resources": v})
    print(json.dumps({"arch": a.arch, "triton": triton.__version__, "variants": variants, "failures": failures,
                      "derived": [d[0] for d in derived], "kernels": _all_kernels(), "digests": digests,
                      "compiled_kernels": sorted({v["kernel"] for v in variants})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Property-based fuzz of the public API (issue 52), run by ``tests/test_fuzz.py`` in a subprocess of its own.

Each case is a *spec*, a dict of plain values (entry point, level, loss, sizes, sequence lengths, layout, dtypes,
views, clip band, options, a tensor seed and at most one corruption) that hypothesis draws; the tensors are built
from it, so a case prints as one line of JSON and replays by itself (``python tools/fuzz_api.py --replay
'<json>'``). Oracles:

* a valid call: loss, metrics and every gradient (logits / hidden, weight and bias, the reference, advantages, the
  KL reference, a tensor normalizer) equal ``hk.reference``'s on the padded layout of the same numbers (the loss
  alone where the reference's is not finite); where the reference refuses (a ``ValueError``), the call refuses;
* a corrupted argument: a ``ValueError`` or ``TypeError`` whose message names the argument, raised before any
  kernel launch;
* an unchecked corruption (``validate=False`` with labels outside the vocabulary, or broken ``cu_seqlens``): any
  result or error, but no crash and no write outside a buffer;
* always: no input tensor modified (the logits aside with ``inplace_backward``), and the guard elements placed
  before and after every input tensor's storage untouched.

Before each case the worker appends it to ``--log`` (flushed): a case that kills the process (an abort, a
segfault, a CUDA error) is named by the log's last line. ``--device cuda`` runs the compiled kernels; the
corruptions whose check is a device-side assert there (it ends the CUDA context) are left to the CPU run, their
unchecked (``validate=False``) twins run on both.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import humanline_kernels as hk  # noqa: E402
from humanline_kernels.ops import _jit  # noqa: E402

R = hk.reference
LOSSES = ("dpo", "kto", "grpo", "sequence_logratios", "ipo", "simpo", "slic")
PAIRED = ("dpo", "ipo", "simpo", "slic")
DPO_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sigmoid_norm", "apo_zero", "apo_down", "nca_pair", "sppo_hard",
             "discopop", "exo_pair", "sft", "aot")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
GUARD = 16  # sentinel elements before and after every input tensor's storage
# corruptions whose check reads values: a device-side assert on CUDA, which ends the context
DEVICE_ASSERTS = {"label_range", "cu_first", "cu_decreasing", "cu_end", "cu_longer_than_max", "unsupervised_label"}


# ------------------------------------------------------------------ specs (hypothesis strategies)
def specs(st, device="cpu"):
    """The hypothesis strategy of a case."""

    @st.composite
    def spec(draw):
        entry = draw(st.sampled_from(["loss"] * 12 + ["token_logprobs"] * 2 + ["syncer"]))
        if entry == "syncer":
            return dict(entry="syncer", level="sync", loss=None, corrupt=None, interp=None,
                        policy=draw(st.sampled_from(SYNC_ARGS)), reference=draw(st.sampled_from(SYNC_ARGS)),
                        every=draw(st.sampled_from([1, 1, 3, 3, 0, -2, 1.5, True, "2"])),
                        state=draw(st.sampled_from(SYNC_STATES)))
        level = draw(st.sampled_from(["losses", "fused", "fused_linear"] if entry == "loss" else
                                     ["fused", "fused_linear"]))
        loss = draw(st.sampled_from(LOSSES)) if entry == "loss" else None
        S = draw(st.integers(1, 5))
        if loss in PAIRED and draw(st.integers(0, 9)) > 0:
            S = 2 * draw(st.integers(1, 3))  # mostly even: the pair losses' valid row counts
        layouts = ["padded", "packed_list", "packed_tensor", "packed_device"]
        if level == "fused_linear":
            layouts += ["supervised", "packed+supervised"]
        if entry == "token_logprobs":
            layouts = ["padded", "supervised"] if level == "fused_linear" else ["padded"]
        layout = draw(st.sampled_from(layouts))
        s = dict(entry=entry, level=level, loss=loss, S=S, layout=layout,
                 lens=draw(st.lists(st.integers(0, 7), min_size=S, max_size=S)),
                 extra=draw(st.integers(0, 2)) if layout in ("padded", "supervised", "packed_device") else 0,
                 V=draw(st.integers(2, 40)), D=draw(st.integers(1, 6)), seed=draw(st.integers(0, 2 ** 31 - 1)),
                 dtype=draw(st.sampled_from(["float32", "float32", "bfloat16", "float16", "float64"])),
                 logp_dtype=draw(st.sampled_from(["float32", "float32", "float64"])),
                 view=draw(st.sampled_from(["contiguous", "contiguous", "sliced", "batch_major"]))
                 if "packed" not in layout else "contiguous",
                 ignore_index=draw(st.sampled_from([-100, -100, -1])),
                 temperature=draw(st.sampled_from([1.0, 1.0, 0.7, 1.6])),
                 scale=draw(st.sampled_from([1.0, 1.0, 4.0, 30.0])),
                 ref_spread=draw(st.sampled_from([0.3, 1.0, 3.0])),
                 prompt=draw(st.sampled_from([0.0, 0.2, 0.5])),
                 special=draw(st.sampled_from([None] * 8 + ["neg_inf_off_label", "neg_inf_at_label", "nan",
                                                            "pos_inf", "pos_inf_off_label", "neg_inf_row"])),
                 clip=draw(st.sampled_from(["none", "default", "band"])),
                 band=[draw(st.sampled_from([0.0, -0.05, -0.4, -1.2, -3.0])),
                       draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]))],
                 validate=draw(st.sampled_from([True, True, False])),
                 # CPU tensors: the Triton interpreter or the eager path; CUDA ones always run compiled, and the
                 # variable stays unset there (it would make Triton interpret other libraries' kernels too)
                 interp=None if device != "cpu" else draw(st.sampled_from(["1", "1", "0"])),
                 grads=draw(st.sampled_from(["x", "x", "x+inputs", "inputs"])),
                 bias=draw(st.booleans()), chunk=draw(st.sampled_from([None, 1, 3, 9])),
                 return_entropy=draw(st.booleans()), opts=_options(draw, st, loss, level))
        kinds = sorted(corruptions(s, device))
        kinds += [k for k in kinds if k.startswith("unchecked")] * 4  # the memory-safety cases, more often
        s["corrupt"] = draw(st.sampled_from([None] * max(3, len(kinds) // 3) + kinds))
        return s
    return spec()


def _options(draw, st, loss, level):
    """A loss's keywords (some combinations out of range: the reference refuses those, and so must every level)."""
    o = {}
    if loss == "dpo":
        o["beta"] = draw(st.sampled_from([0.1, 0.5, 2.0, 0.0]))
        o["label_smoothing"] = draw(st.sampled_from([0.0, 0.0, 0.2]))
        if draw(st.integers(0, 2)) == 0:
            k = draw(st.integers(1, 2))
            types = draw(st.lists(st.sampled_from(DPO_TYPES), min_size=k, max_size=k, unique=True))
            o["loss_type"] = types[0] if k == 1 else types
            if k > 1:
                o["loss_weights"] = [draw(st.sampled_from([1.0, 0.5])) for _ in types]
        if draw(st.integers(0, 4)) == 0:
            o["rpo_alpha"] = 0.3
        if draw(st.integers(0, 4)) == 0:
            o["ld_alpha"] = 0.5
    elif loss == "kto":
        o.update(beta=draw(st.sampled_from([0.1, 1.0])), desirable_weight=draw(st.sampled_from([1.0, 1.3])),
                 undesirable_weight=draw(st.sampled_from([1.0, 0.7])),
                 loss_type=draw(st.sampled_from(["kto", "kto", "apo_zero_unpaired"])),
                 kl_estimate=draw(st.sampled_from(["halos", "trl"])),
                 kl_rows=draw(st.sampled_from([None, "padded", "packed"] if level != "fused_linear" else
                                              [None, "padded"])))
    elif loss == "grpo":
        types = ["dapo", "bnpo", "grpo", "dr_grpo"] + (["cispo", "sapo", "luspo"] if level == "losses" else [])
        o.update(beta=draw(st.sampled_from([0.0, 0.04])), epsilon_low=draw(st.sampled_from([0.2, 0.5])),
                 epsilon_high=draw(st.sampled_from([0.2, 0.28, 2.0])), loss_type=draw(st.sampled_from(types)),
                 advantages=draw(st.sampled_from(["row", "row", "token"])),
                 adv_dtype=draw(st.sampled_from(["float32", "float32", "bfloat16", "float64"])),
                 kl_ref=draw(st.booleans()), normalizer=draw(st.sampled_from([None, None, 3.0, "tensor"])),
                 max_completion_length=draw(st.sampled_from([None, None, 9])))
        if level == "fused":
            o["grad_in_forward"] = draw(st.booleans())
    elif loss == "sequence_logratios":
        o.update(normalize=draw(st.booleans()), no_ref=draw(st.booleans()))
    elif loss == "ipo":
        o["beta"] = draw(st.sampled_from([0.1, 1.0]))
    elif loss == "simpo":
        o.update(beta=draw(st.sampled_from([2.0, 0.5])), gamma_beta_ratio=draw(st.sampled_from([0.25, 0.0])))
    elif loss == "slic":
        o.update(beta=draw(st.sampled_from([1.0, 0.3])), lambda_coef=draw(st.sampled_from([0.1, 0.0])))
    if level == "fused" and loss is not None:
        o["inplace_backward"] = draw(st.integers(0, 5)) == 0
    return o


def corruptions(s, device="cpu"):
    """``{kind: the argument its error must name}`` for the spec. Each kind makes a call that must be refused, or
    (``unchecked_*``) a ``validate=False`` call that must not crash."""
    lvl, loss, layout = s["level"], s["loss"], s["layout"]
    x = {"losses": "logps", "fused": "logits", "fused_linear": "hidden"}[lvl]
    c = {"x_none": x, "x_list": x, "x_dtype": x, "x_flat": x}
    if lvl == "losses":
        c.update(mask_dtype="mask", mask_shape="mask")
    else:
        c.update(labels_dtype="labels", labels_shape="labels", labels_device="labels", label_range="labels",
                 temperature="temperature", ignore_index="ignore_index", unchecked_labels="labels")
        if lvl == "fused":
            c["logits_last_stride"] = "logits"
        else:
            c.update(weight_shape="weight", weight_dtype="weight", bias_shape="bias", chunk_bytes="chunk_bytes")
    if loss is not None:
        if loss not in ("sequence_logratios", "simpo", "slic"):
            c["ref_none"] = "ref_logps"
        if loss not in ("simpo", "slic"):
            c.update(ref_shape="ref_logps", ref_dtype="ref_logps", ref_device="ref_logps", ref_list="ref_logps")
        c.update(clip_type="clip", clip_without_0="log_eps_p")
        if loss != "sequence_logratios":
            c["beta"] = "beta"
        if loss in PAIRED:
            c["odd_rows"] = "even"
        if loss == "grpo":
            c.update(adv_shape="advantages", adv_dtype="advantages", loss_type="loss_type",
                     epsilon_low="epsilon_low", max_completion_length="max_completion_length",
                     normalizer_value="normalizer")
        if loss == "kto":
            c.update(desirable_dtype="desirable", kl_partial="kl_logps")
        if loss == "dpo":
            c["label_smoothing"] = "label_smoothing"
            if lvl != "losses":
                c["use_weighting"] = "use_weighting"
        if "packed" in layout:
            c.update(packed_type="packed", cu_floats="cu_seqlens", max_seqlen_negative="max_seqlen",
                     cu_first="cu_seqlens", cu_decreasing="cu_seqlens", cu_end="cu_seqlens")
            if layout in ("packed_device", "packed_list"):
                c["cu_longer_than_max"] = ("max_seqlen", "cu_seqlens")  # (no sequence to shorten: cu_seqlens)
            if layout == "packed_device" and lvl == "fused":
                c["unchecked_cu"] = "cu_seqlens"
    if "supervised" in layout:
        c.update(supervised_count="supervised", supervised_range="supervised", supervised_floats="supervised",
                 unsupervised_label="supervised")
    if device != "cpu":
        c = {k: v for k, v in c.items() if k not in DEVICE_ASSERTS}
    return c


# ------------------------------------------------------------------ tensors
class Guarded:
    """Places input tensors inside larger buffers with ``GUARD`` sentinel elements on either side."""

    def __init__(self):
        self.bufs = []

    def place(self, t):
        n = t.numel()
        sentinel = True if t.dtype == torch.bool else -7.25e3 if t.is_floating_point() else -7777
        buf = torch.full((GUARD + n + GUARD,), sentinel, dtype=t.dtype, device=t.device)
        buf[GUARD:GUARD + n] = t.reshape(-1)
        self.bufs.append((buf, n, sentinel))
        return buf[GUARD:GUARD + n].view(t.shape)

    def check(self):
        for buf, n, sentinel in self.bufs:
            edges = torch.cat([buf[:GUARD], buf[GUARD + n:]])
            assert bool((edges == sentinel).all()), "a guard element beside an input changed: a write outside it"


def _same(a, b):
    """Bitwise equality, NaN included."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    return torch.equal(a, b)


def build(s):
    """The case's numbers on padded rows ``[S, T]`` (on the CPU): the reference's layout."""
    g = torch.Generator().manual_seed(s["seed"])
    S, lens, V, D = s["S"], s["lens"], s["V"], s["D"]
    T = max(lens, default=0) + s["extra"]
    dt, ldt = DTYPES[s["dtype"]], DTYPES[s["logp_dtype"]]
    ii = s["ignore_index"]
    pos = torch.arange(T)
    inside = pos[None, :] < torch.tensor(lens, dtype=torch.int64)[:, None]
    labels = torch.randint(0, V, (S, T), generator=g)
    labels = torch.where(inside & (torch.rand(S, T, generator=g) >= s["prompt"]), labels, ii)
    b = dict(T=T, labels=labels, cu=_cumsum(lens))
    if s["level"] == "fused_linear":
        b["hidden"] = (torch.randn(S, T, D, generator=g) * math.sqrt(s["scale"] / D)).to(dt)
        b["weight"] = torch.randn(V, D, generator=g).to(dt)
        b["bias"] = (torch.randn(V, generator=g) * 0.5).to(dt) if s["bias"] else None
        logits = b["hidden"] @ b["weight"].T + (b["bias"] if s["bias"] else 0)
    else:
        b["logits"] = logits = (torch.randn(S, T, V, generator=g) * s["scale"]).to(dt)
        _special(s, logits, labels, g)
    lp = R.token_logprobs(logits, labels, temperature=s["temperature"], ignore_index=ii)
    mask = labels != ii
    finite = torch.where(torch.isfinite(lp), lp, torch.zeros_like(lp))
    b.update(logps=lp.to(ldt), mask=mask,
             ref_logps=torch.where(mask, finite + s["ref_spread"] * torch.randn(S, T, generator=g), 0.0).to(ldt))
    o = s["opts"]
    if s["loss"] == "grpo":
        adv = torch.randn(S, generator=g) if o["advantages"] == "row" else torch.randn(S, T, generator=g)
        b["advantages"] = adv.to(DTYPES[o["adv_dtype"]])
        if o["kl_ref"]:
            b["kl_ref_logps"] = torch.where(mask, finite + 0.5 * torch.randn(S, T, generator=g), 0.0).to(ldt)
        if o["normalizer"] == "tensor":
            b["normalizer"] = torch.tensor(7.0)
    if s["loss"] == "kto":
        b["desirable"] = torch.rand(S, generator=g) < 0.5
        kl_lens = torch.randint(0, T + 1, (3,), generator=g).tolist()
        klm = pos[None, :] < torch.tensor(kl_lens)[:, None]
        b["kl"] = (torch.where(klm, -3 * torch.rand(3, T, generator=g), 0.0).to(ldt),
                   torch.where(klm, -3 * torch.rand(3, T, generator=g), 0.0).to(ldt), klm, kl_lens)
    b["coef"] = torch.randn(S, T, generator=g)  # fixed weights of a per-token or per-sequence output's objective
    b["coef_s"] = torch.randn(S, generator=g)
    # the reference's padded width: the call's max_seqlen when given, else the longest sequence
    b["width"] = T if s["layout"] in ("padded", "supervised", "packed_device") else max(lens, default=0)
    return b


def _special(s, x, labels, g):
    """Non-finite logits where the spec asks: -inf off the label (a masked vocabulary entry), -inf at it, a row of
    -inf, NaN, +inf at the label or off it."""
    kind = s["special"]
    if kind is None or x.numel() == 0:
        return
    S, T, V = x.shape
    i, t = int(torch.randint(0, S, (1,), generator=g)), int(torch.randint(0, T, (1,), generator=g))
    y = max(int(labels[i, t]), 0)
    if kind == "neg_inf_row":
        x[i, t] = -math.inf
        return
    col = y if kind in ("neg_inf_at_label", "pos_inf") else (y + 1) % V
    x[i, t, col] = math.nan if kind == "nan" else math.inf if kind.startswith("pos") else -math.inf


def _cumsum(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return c


def pack(t, lens):
    """Padded ``[S, T, ...]`` rows as the packed stream ``[N, ...]``."""
    return torch.cat([t[i, :n] for i, n in enumerate(lens)]) if lens else t.reshape(0, *t.shape[2:])


def unpack(t, lens, width, fill):
    """:func:`pack`'s inverse, differentiable: the stream on padded rows of ``width``, ``fill`` elsewhere."""
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64))
    pos = torch.cat([torch.arange(n) for n in lens]).to(torch.int64) if lens else torch.zeros(0, dtype=torch.int64)
    out = t.new_full((len(lens), width, *t.shape[1:]), fill)
    return out.index_put((seq.to(t.device), pos.to(t.device)), t)


def _view(s, t, name):
    """``(storage, view)``: ``t`` stored as the spec asks, and the function that views the storage as ``t``."""
    if s["view"] == "sliced" and t.dim() >= 2:
        wide = torch.zeros((t.shape[0], t.shape[1] + 1, *t.shape[2:]), dtype=t.dtype)
        if name == "labels":  # labels[:, 1:] and logits[:, :-1], as a causal LM's shift makes them
            wide[:, 1:] = t
            return wide, (lambda w: w[:, 1:])
        wide[:, :-1] = t
        return wide, (lambda w: w[:, :-1])
    if s["view"] == "batch_major" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous(), (lambda w: w.transpose(0, 1))
    return t, (lambda w: w)


PER_TOKEN = ("logps", "mask", "logits", "hidden", "labels", "ref_logps", "kl_ref_logps", "advantages")


class Case:
    """A spec's call: its arguments (on ``device``, in guarded storage), the leaves it differentiates, and the
    views that make each argument of its storage."""

    def __init__(self, s, device):
        self.s, self.device = s, device
        self.b = build(s)
        self.guard = Guarded()
        self.a, self.leaves, self.views, self.packed = {}, {}, {}, set()
        packed = "packed" in s["layout"]
        S = s["S"]
        grads = s["grads"]
        want_x = "x" in grads or s["entry"] == "token_logprobs"
        want_in = "inputs" in grads
        lvl, loss = s["level"], s["loss"]
        names = {"losses": ["logps", "mask"], "fused": ["logits", "labels"],
                 "fused_linear": ["hidden", "weight", "bias", "labels"]}[lvl]
        if loss not in (None, "simpo", "slic") and not (loss == "sequence_logratios" and s["opts"]["no_ref"]):
            names.append("ref_logps")
        names += [k for k in ("advantages", "kl_ref_logps", "normalizer", "desirable") if k in self.b]
        for name in names:
            t = self.b.get(name)
            if t is None:
                continue
            per_token = name in PER_TOKEN and not (name == "advantages" and t.dim() == 1)
            if packed and per_token:
                t = pack(t, s["lens"])
                self.packed.add(name)
                if name == "advantages" and t.shape[0] == S:  # [S] is one per sequence: per token, [1, N]
                    t = t.unsqueeze(0)
            store, view = _view(s, t, name) if per_token and not packed else (t, lambda w: w)
            placed = self.guard.place(store.to(device))
            grad = want_x if name in ("logps", "logits", "hidden", "weight", "bias") else \
                want_in if name in ("ref_logps", "advantages", "kl_ref_logps", "normalizer") else False
            if grad:
                self.leaves[name] = placed.requires_grad_()
            self.views[name] = view
            self.a[name] = view(placed)
        if loss == "sequence_logratios" and "ref_logps" not in self.a:
            self.a["ref_logps"] = None
        if loss == "kto" and s["opts"]["kl_rows"] and s["opts"]["loss_type"] == "kto":
            kl, klr, klm, kl_lens = self.b["kl"]
            if s["opts"]["kl_rows"] == "packed":
                kl, klr, klm = (pack(t, kl_lens) for t in (kl, klr, klm))
                self.a["kl_packed"] = hk.Packed(_cumsum(kl_lens))
            for name, t in zip(("kl_logps", "kl_ref_logps_kto", "kl_mask"), (kl, klr, klm)):
                self.a[name] = self.guard.place(t.to(device))
        cu = self.b["cu"]
        if s["layout"] in ("packed_list", "packed+supervised"):
            self.a["packed"] = hk.Packed(cu)
        elif s["layout"] == "packed_tensor":
            self.a["packed"] = hk.Packed(torch.tensor(cu))  # a CPU tensor: read on the host
        elif s["layout"] == "packed_device":
            self.a["packed"] = hk.Packed(self.guard.place(torch.tensor(cu).to(device)), max_seqlen=self.b["width"])
        if "supervised" in s["layout"]:
            self.a["supervised"] = _ranges(self.b, s)
        self.kw = keywords(s)

    def tensors(self, a):
        for k, v in a.items():
            if isinstance(v, torch.Tensor) and v.device.type != "meta":
                yield k, v
            elif isinstance(v, hk.Packed) and isinstance(v.cu_seqlens, torch.Tensor):
                yield k + ".cu_seqlens", v.cu_seqlens


def _ranges(b, s):
    """Per row the smallest ``[start, end)`` that holds every labelled position (every other one a position wider)."""
    out = []
    for i, n in enumerate(s["lens"]):
        idx = (b["labels"][i, :n] != s["ignore_index"]).nonzero().flatten().tolist()
        out.append([idx[0] - (idx[0] > 0 and i % 2), idx[-1] + 1] if idx else [0, 0])
    return out


def keywords(s):
    """The call's keywords: the spec's options at the level's names."""
    o, kw = s["opts"], {}
    lvl, loss = s["level"], s["loss"]
    if loss is not None:
        kw["clip"] = {"none": None, "default": hk.HumanlineClip(), "band": "band"}[s["clip"]]
        if kw["clip"] == "band":
            p, r = s["band"]
            if loss in ("simpo", "slic") or (loss == "sequence_logratios" and o["no_ref"]):
                # a reference of 0: the log-ratio is the log-prob, exactly 0 for a certain token in one rounding and
                # not in another, so a band end at 0 would make unclipped_frac (strict) a coin flip
                p, r = p or -0.05, r or 0.05
            kw["clip"] = hk.HumanlineClip(p, r)
    for k in ("beta", "label_smoothing", "loss_type", "loss_weights", "rpo_alpha", "ld_alpha", "desirable_weight",
              "undesirable_weight", "kl_estimate", "epsilon_low", "epsilon_high", "max_completion_length",
              "normalize", "gamma_beta_ratio", "lambda_coef", "grad_in_forward", "inplace_backward"):
        if k in o and o[k] is not False:
            kw[k] = o[k]
    if loss == "grpo" and isinstance(o["normalizer"], float):
        kw["normalizer"] = o["normalizer"]
    if lvl != "losses":
        kw.update(temperature=s["temperature"], ignore_index=s["ignore_index"], validate=s["validate"])
        if lvl == "fused_linear" and s["chunk"] is not None:
            kw["chunk_bytes"] = s["chunk"] * s["V"] * DTYPES[s["dtype"]].itemsize
        if s["entry"] == "token_logprobs":
            kw["return_entropy"] = s["return_entropy"]
    return kw


# ------------------------------------------------------------------ hk.ReferenceSyncer
SYNC_ARGS = ["module"] * 8 + ["same", "dict", "none", "list"]
SYNC_STATES = ["own"] * 4 + ["missing_step", "list", "negative_step", "float_step", "bool_step", "zero_every", "none"]


def run_syncer(s):
    """``hk.ReferenceSyncer(policy, reference, every)`` and ``load_state_dict``: a ValueError naming the argument
    for a non-module (a dict, None, a list, the policy itself as its reference), an ``every`` that is not a
    positive int, a state that is not ``state_dict()``'s form; else a state round trip that keeps the step."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(3, 2)
    other = {"module": torch.nn.Linear(3, 2), "same": policy, "dict": {"weight": torch.zeros(2, 3)}, "none": None,
             "list": [torch.nn.Linear(3, 2)]}
    args = (policy if s["policy"] in ("module", "same") else other[s["policy"]], other[s["reference"]])
    bad = [(name, kind) for name, kind in (("policy", s["policy"]), ("reference", s["reference"]))
           if kind in ("dict", "none", "list")]
    if s["reference"] == "same" and s["policy"] in ("module", "same"):
        bad.append(("reference", "same"))  # the policy itself as its reference
    every = s["every"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        bad.append(("every", every))
    if bad:
        try:
            hk.ReferenceSyncer(*args, every=every)
        except ValueError as e:
            assert any(name in str(e) for name, _ in bad), f"the error does not name one of {bad}: {e}"
            return "refused"
        raise AssertionError(f"accepted; expected a ValueError naming one of {bad}")
    syncer = hk.ReferenceSyncer(*args, every=every, overlap=False)
    syncer.sync()
    own = syncer.state_dict()
    state = {"own": own, "missing_step": {"every": every}, "list": [own["step"]], "none": None,
             "negative_step": dict(own, step=-1), "float_step": dict(own, step=1.5), "bool_step": dict(own, step=True),
             "zero_every": dict(own, every=0)}[s["state"]]
    if s["state"] != "own":
        try:
            syncer.load_state_dict(state)
        except ValueError as e:
            assert "state" in str(e), f"the error does not name the state: {e}"
            assert syncer.state_dict() == own, "a refused state was half applied"
            return "refused"
        raise AssertionError(f"load_state_dict accepted {state!r}")
    fresh = hk.ReferenceSyncer(torch.nn.Linear(3, 2), torch.nn.Linear(3, 2), every=every, overlap=False)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == own
    return "ok"


# ------------------------------------------------------------------ the call, the reference, the oracle
def call(s, a, kw):
    """The public call of the spec with the arguments ``a`` and keywords ``kw`` (lazy ones built here, so that
    their constructors' refusals count as the call's)."""
    a = {k: (v() if callable(v) else v) for k, v in a.items()}
    kw = {k: (v() if callable(v) else v) for k, v in kw.items()}
    lvl, loss = s["level"], s["loss"]
    if s["entry"] == "token_logprobs":
        if lvl == "fused":
            return hk.token_logprobs(a.get("logits"), a.get("labels"), **kw)
        extra = {k: a[k] for k in ("bias", "supervised") if k in a}
        return hk.fused_linear.token_logprobs(a.get("hidden"), a.get("weight"), a.get("labels"), **extra, **kw)
    head = {"losses": ["logps"], "fused": ["logits", "labels"], "fused_linear": ["hidden", "weight", "labels"]}[lvl]
    mid = {"grpo": ["ref_logps", "advantages"], "simpo": [], "slic": []}.get(loss, ["ref_logps"])
    args = [a.get(k) for k in head + mid] + ([a.get("mask")] if lvl == "losses" else [])
    if loss == "kto":
        args += [a.get("desirable"), a.get("kl_logps"), a.get("kl_ref_logps_kto"), a.get("kl_mask")]
    extra = {k: a[k] for k in ("bias", "supervised", "packed", "kl_packed", "normalizer", "kl_ref_logps") if k in a}
    mod = {"losses": hk.losses, "fused": hk.fused, "fused_linear": hk.fused_linear}[lvl]
    return getattr(mod, loss)(*args, **extra, **kw)


def objective(s, out, b):
    """A scalar of every differentiable output: the loss; ``sum(c s) + sum(c' policy_sums)`` for the sequence sums;
    ``sum(c logps)`` (+ the entropy's) for token log-probs, the weights ``c`` fixed by the case."""
    if s["entry"] == "token_logprobs":
        lp, ent = out if s["return_entropy"] else (out, None)
        c = b["coef"].to(lp.device).reshape(lp.shape)
        return (c * lp.float()).sum() + (0.3 * (c * ent.float()).sum() if ent is not None else 0.0)
    if s["loss"] == "sequence_logratios":
        c = b["coef_s"].to(out[0].device)
        return (c * out[0].float()).sum() + 0.5 * (c.flip(0) * out[1].float()).sum()
    return out[0]


def reference(case):
    """``hk.reference`` on the padded layout of the call's numbers, differentiated at clones of the call's leaves:
    ``(outputs, clones)``."""
    s, a, b = case.s, case.a, case.b
    lens, width, ii = s["lens"], b["width"], s["ignore_index"]
    clones = {k: v.detach().clone().requires_grad_() for k, v in case.leaves.items()}

    def val(name, fill=0.0):
        t = case.views[name](clones[name]) if name in clones else a[name].detach()
        if name in case.packed:
            t = t.reshape(-1, *t.shape[2:]) if name == "advantages" else t
            t = unpack(t, lens, width, fill)
        return t

    lvl = s["level"]
    if lvl == "losses":
        lp, mask = val("logps"), val("mask", False)
    else:
        labels = val("labels", ii)
        logits = val("logits") if lvl == "fused" else \
            val("hidden") @ val("weight").T + (val("bias") if "bias" in a else 0)
        tok = dict(temperature=s["temperature"], ignore_index=ii, validate=False)
        if s["entry"] == "token_logprobs":
            return R.token_logprobs(logits, labels, return_entropy=s["return_entropy"], **tok), clones
        mask = labels != ii
        lp = R.token_logprobs(logits, labels, **tok)
    kw = {k: v for k, v in case.kw.items() if k not in ("temperature", "ignore_index", "validate", "grad_in_forward",
                                                        "inplace_backward", "chunk_bytes")}
    loss = s["loss"]
    ref = val("ref_logps") if a.get("ref_logps") is not None else None
    if ref is not None:
        lp = lp.to(ref.dtype)
    if loss == "grpo":
        if "normalizer" in a:
            kw["normalizer"] = clones.get("normalizer", a["normalizer"])
        klr = val("kl_ref_logps") if "kl_ref_logps" in a else None
        return R.grpo(lp, ref, val("advantages"), mask, kl_ref_logps=klr, **kw), clones
    if loss == "kto":
        kl = [a.get(k) for k in ("kl_logps", "kl_ref_logps_kto", "kl_mask")]
        if "kl_packed" in a:
            kl_lens = b["kl"][3]
            kl = [unpack(t, kl_lens, max(kl_lens, default=0), f) for t, f in zip(kl, (0.0, 0.0, False))]
        return R.kto(lp, ref, mask, a["desirable"], *kl, **kw), clones
    if loss in ("simpo", "slic"):
        return getattr(R, loss)(lp, mask, **kw), clones
    return getattr(R, loss)(lp, ref, mask, **kw), clones


def run(s, device="cpu"):
    """One case against its oracle: ``"ok"``, ``"refused"`` or ``"unchecked"``; AssertionError on a wrong answer."""
    if s["entry"] == "syncer":
        return run_syncer(s)
    if s["interp"] is not None:
        os.environ["TRITON_INTERPRET"] = s["interp"]
    case = Case(s, device)
    try:
        ref_out, clones = reference(case)
    except ValueError as e:  # the reference refuses: so must the call
        return refused(case, case.a, case.kw, None, why=str(e))
    if s["corrupt"] is not None:
        a, kw = corrupt(case, s["corrupt"])
        return refused(case, a, kw, corruptions(s, device)[s["corrupt"]])
    snapshot = {k: v.detach().clone() for k, v in case.tensors(case.a)}
    try:
        out = call(s, case.a, case.kw)
    except ValueError as e:  # what a level documents it cannot compute (e.g. "aot" with LD weights above the
        # log-prob level) is refused by name, pointing to the level that can
        if s["level"] == "losses" or "hk.losses" not in str(e):
            raise
        return "refused"
    names = list(case.leaves)
    obj = objective(s, out, case.b)
    got = _grads(obj, [case.leaves[k] for k in names])
    ref_obj = objective(s, ref_out, case.b)
    want = _grads(ref_obj, [clones[k] for k in names])
    # docs/design.md's numerics: values to 1e-5 (fp32) / 2e-3 (bf16) of the fp32 reference, here 1e-4 / 1e-2 after the
    # loss's own arithmetic; gradients to 1e-2 relative norm (a confident token's 1 - p cancels in fp32)
    tol = 1e-2 if s["dtype"] in ("bfloat16", "float16") else 1e-4
    _close("the objective", obj, ref_obj, tol)
    if bool(torch.isfinite(ref_obj.detach()).all()):  # (with a NaN or inf loss only the loss itself is compared)
        if s["entry"] == "loss" and s["loss"] != "sequence_logratios":
            for k, v in ref_out[1].items():
                assert k in out[1], f"metric {k} missing"
                _close(f"metric {k}", out[1][k], v, tol)
        for k, g, w in zip(names, got, want):
            if w is None:
                continue
            assert g is not None, f"the gradient of {k} was dropped (the reference has one)"
            if bool(torch.isfinite(w).all()):
                # (the lm_head's gradients sum a token's bf16 dL/dz over the tokens: with few tokens, terms that
                # cancel leave a few per cent of rounding on either side, the reference's bf16 GEMM included)
                _close(f"the gradient of {k}", g, w, 3 * tol if k in ("weight", "bias") else tol, norm=True)
    for k, t in case.tensors(case.a):
        if k == "logits" and s["opts"].get("inplace_backward"):
            continue
        assert _same(t.detach(), snapshot[k]), f"the call modified its input {k}"
    case.guard.check()
    return "ok"


def _grads(obj, leaves):
    if not leaves or not isinstance(obj, torch.Tensor) or not obj.requires_grad:
        return [None] * len(leaves)
    return torch.autograd.grad(obj, leaves, allow_unused=True)


def _close(what, a, b, tol, norm=False):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)}, the reference's {tuple(b.shape)}"
    if norm:
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: NaN where the reference has none"
        err = float((a - b).norm() / max(float(b.norm()), 1e-3))
        assert err <= max(3 * tol, 1e-2), f"{what}: relative error {err:.3g} (tolerance {max(3 * tol, 1e-2):g})"
        return
    scale = max(1.0, float(b.abs().nan_to_num(posinf=0, neginf=0).max())) if b.numel() else 1.0
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, equal_nan=True, msg=lambda m: f"{what}: {m}")


def refused(case, a, kw, expect, why=None):
    """The call must raise a ValueError / TypeError naming ``expect`` before any kernel launch; an ``unchecked_*``
    corruption may give any result or error, but no crash. Inputs untouched either way."""
    s = case.s
    unchecked = (s["corrupt"] or "").startswith("unchecked")
    snapshot = {k: v.detach().clone() for k, v in case.tensors(a)}
    launches = sum(_jit.LAUNCHES.values())
    try:
        out = call(s, a, kw)
    except (ValueError, TypeError) as e:
        if not unchecked:
            names = (expect,) if isinstance(expect, str) else expect or ()
            assert not names or any(n in str(e) for n in names), \
                f"the error does not name {expect!r}: {type(e).__name__}: {e}"
            assert sum(_jit.LAUNCHES.values()) == launches, f"a kernel ran before the refusal: {e}"
    else:
        assert unchecked, f"accepted; expected a ValueError naming {expect!r}" + \
            (f" (the reference refuses: {why})" if why else "")
        obj = objective(s, out, case.b)
        if isinstance(obj, torch.Tensor) and obj.requires_grad:
            obj.backward()
        if case.device != "cpu":  # (an asynchronous fault surfaces here, inside the case)
            torch.cuda.synchronize()
    for k, t in case.tensors(a):
        if k == "logits" and s["opts"].get("inplace_backward"):
            continue
        assert _same(t.detach(), snapshot[k]), f"the call modified its input {k}"
    case.guard.check()
    return "unchecked" if unchecked else "refused"


# ------------------------------------------------------------------ corruptions
def corrupt(case, kind):
    """The call's arguments and keywords with one corruption ``kind`` (:func:`corruptions`); a callable is built
    inside the call."""
    s, b = case.s, case.b
    a, kw = dict(case.a), dict(case.kw)
    x = {"losses": "logps", "fused": "logits", "fused_linear": "hidden"}[s["level"]]
    t = a.get(x)
    if kind == "x_none":
        a[x] = None
    elif kind == "x_list":
        a[x] = t.detach().tolist()
    elif kind == "x_dtype":
        a[x] = t.detach().half() if x == "logps" else t.detach().to(torch.int64)
    elif kind == "x_flat":  # (a packed batch's log-probs are flat already: one dimension too many then)
        a[x] = t.detach().reshape(1, 1, -1) if x == "logps" and "packed" in s["layout"] else t.detach().reshape(-1)
    elif kind == "logits_last_stride":
        a[x] = torch.stack([t.detach(), t.detach()], -1)[..., 0]  # last stride 2
    elif kind == "labels_dtype":
        a["labels"] = a["labels"].to(torch.int32)
    elif kind == "labels_shape":
        a["labels"] = torch.cat([a["labels"], a["labels"][..., :1]], -1)
    elif kind == "labels_device":
        a["labels"] = a["labels"].to("meta")
    elif kind in ("label_range", "unchecked_labels"):
        y = a["labels"].contiguous().clone()
        if y.numel() == 0:
            a["labels"] = y.to(torch.int32)  # (nothing to put out of range: refused for its dtype, by name)
        else:
            y.view(-1)[y.numel() // 2] = s["V"] + 3
            y.view(-1)[0] = -5
            a["labels"] = y
        kw["validate"] = kind == "label_range"
    elif kind == "temperature":
        kw["temperature"] = 0.0
    elif kind == "ignore_index":
        kw["ignore_index"] = 1.5
    elif kind == "weight_shape":
        a["weight"] = torch.zeros(s["V"], s["D"] + 1, dtype=a["weight"].dtype)
    elif kind == "weight_dtype":
        a["weight"] = a["weight"].detach().to(torch.float64 if s["dtype"] != "float64" else torch.float32)
    elif kind == "bias_shape":
        a["bias"] = torch.zeros(s["V"] + 1, dtype=DTYPES[s["dtype"]])
    elif kind == "chunk_bytes":
        kw["chunk_bytes"] = 0
    elif kind == "mask_dtype":
        a["mask"] = a["mask"].float()
    elif kind == "mask_shape":
        m = a["mask"]
        a["mask"] = torch.cat([m, m.new_ones(*m.shape[:-1], 1)], -1)
    elif kind == "ref_none":
        a["ref_logps"] = None
    elif kind == "ref_shape":
        r = b["ref_logps"]
        a["ref_logps"] = torch.zeros(r.shape[0] + 1, *r.shape[1:], dtype=r.dtype)
    elif kind == "ref_dtype":
        a["ref_logps"] = b["ref_logps"].to(torch.int64)
    elif kind == "ref_device":
        a["ref_logps"] = a["ref_logps"].detach().to("meta") if a.get("ref_logps") is not None else \
            b["ref_logps"].to("meta")
    elif kind == "ref_list":
        a["ref_logps"] = b["ref_logps"].tolist()
    elif kind == "clip_type":
        kw["clip"] = (-1.0, 1.0)
    elif kind == "clip_without_0":
        kw["clip"] = lambda: hk.HumanlineClip(0.5, 1.0)
    elif kind == "beta":
        kw["beta"] = -0.5
    elif kind == "odd_rows":
        _odd(case, a)
    elif kind == "adv_shape":
        adv = b["advantages"]
        a["advantages"] = torch.zeros(adv.shape[0] + 1, *adv.shape[1:], dtype=adv.dtype)
    elif kind == "adv_dtype":
        a["advantages"] = b["advantages"].to(torch.int64)
        if "packed" in s["layout"] and b["advantages"].dim() == 2:
            a["advantages"] = pack(a["advantages"], s["lens"])
    elif kind == "loss_type":
        kw["loss_type"] = "nope"
    elif kind == "epsilon_low":
        kw["epsilon_low"] = 1.5
    elif kind == "max_completion_length":
        kw["max_completion_length"] = 0
    elif kind == "normalizer_value":
        a.pop("normalizer", None)
        kw.update(normalizer=-1.0, loss_type="dapo")
    elif kind == "desirable_dtype":
        a["desirable"] = a["desirable"].float()
    elif kind == "kl_partial":
        a["kl_logps"], a["kl_ref_logps_kto"], a["kl_mask"] = b["kl"][0], None, None
        a.pop("kl_packed", None)
        kw["loss_type"] = "kto"
    elif kind == "label_smoothing":
        kw["label_smoothing"] = 0.7
    elif kind == "use_weighting":
        kw["use_weighting"] = True
    elif kind == "packed_type":
        a["packed"] = b["cu"]
    elif kind == "cu_floats":
        a["packed"] = lambda: hk.Packed([v + 0.5 for v in b["cu"]])
    elif kind == "max_seqlen_negative":
        a["packed"] = lambda: hk.Packed(b["cu"], max_seqlen=-1)
    elif kind in ("cu_first", "cu_decreasing", "cu_end", "cu_longer_than_max", "unchecked_cu"):
        a["packed"] = _bad_packed(case, kind)
        if s["level"] != "losses":  # (validate=False skips the device-side check of tensor boundaries)
            kw["validate"] = kind != "unchecked_cu"
    elif kind == "supervised_count":
        a["supervised"] = a["supervised"][:-1]
    elif kind == "supervised_range":  # one position past the row (padded) or the sequence (packed)
        a["supervised"] = [[0, (n if "packed" in s["layout"] else b["T"]) + 1] for n in s["lens"]]
    elif kind == "supervised_floats":
        a["supervised"] = [[x + 0.5, y] for x, y in a["supervised"]]
    elif kind == "unsupervised_label":  # (the one check that validate=False skips here)
        a["supervised"] = _shortened(a["supervised"])
        kw["validate"] = True
    return a, kw


def _odd(case, a):
    """One row (sequence) fewer: an odd count for the pair losses."""
    s = case.s
    lens = s["lens"][:-1]
    for k in ("logps", "mask", "logits", "hidden", "labels", "ref_logps"):
        if isinstance(a.get(k), torch.Tensor):
            a[k] = a[k].detach()[:sum(lens)] if "packed" in s["layout"] else a[k].detach()[:-1]
    if "packed" in s["layout"]:
        a["packed"] = hk.Packed(_cumsum(lens))
    if "supervised" in a:
        a["supervised"] = a["supervised"][:-1]


def _bad_packed(case, kind):
    """Boundaries that break one rule, in the spec's form (host list, CPU tensor, device tensor + max_seqlen)."""
    s, cu = case.s, list(case.b["cu"])
    N = cu[-1]
    if kind in ("cu_first", "unchecked_cu"):
        cu[0] = 1 if N else -1
    elif kind == "cu_decreasing":
        cu = [0, N + 1] + cu[1:] if len(cu) > 1 else [0, 1, 0]
        cu[-1] = N
    elif kind == "cu_end":
        cu[-1] = N + 1
    max_seqlen = case.a["packed"].max_seqlen
    if kind == "cu_longer_than_max":  # one sequence longer than max_seqlen (or, if all are empty, one position more)
        longest = max((y - x for x, y in zip(cu, cu[1:])), default=0)
        max_seqlen = max(longest - 1, 0)
        if longest == 0:
            cu[-1] = N + 1
    if s["layout"] in ("packed_list", "packed+supervised"):
        return lambda: hk.Packed(cu, max_seqlen=max_seqlen)
    if s["layout"] == "packed_tensor":
        return lambda: hk.Packed(torch.tensor(cu))
    dev = case.device
    return lambda: hk.Packed(case.guard.place(torch.tensor(cu).to(dev)), max_seqlen=max_seqlen)


def _shortened(ranges):
    """The ranges with the first non-empty one a position shorter at its end (always a labelled position: only starts
    are widened); with none, one range fewer."""
    rng = [list(r) for r in ranges]
    for r in rng:
        if r[1] > r[0]:
            r[1] -= 1
            return rng
    return rng[:-1]


# ------------------------------------------------------------------ the worker
def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=52)
    ap.add_argument("--log", default=None, help="each case is appended here (flushed) before it runs")
    ap.add_argument("--replay", default=None, help="one case's JSON spec")
    ap.add_argument("--survey", action="store_true", help="record every failing case and go on (no shrinking)")
    ap.add_argument("--cases", default=None, help="a file of cases (JSON lines, as --log writes them): run these")
    args = ap.parse_args(argv)
    if args.replay:
        print(run(json.loads(args.replay), args.device))
        return 0
    counts = {}
    log = open(args.log, "a") if args.log else None

    def one(spec):
        if log:
            log.write(json.dumps(spec) + "\n")
            log.flush()
        try:
            outcome = run(spec, args.device)
        except Exception as e:
            if not args.survey:
                raise
            outcome = "FAILED"
            print(f"FAILED {type(e).__name__}: {str(e)[:300]}\n  {json.dumps(spec)}", flush=True)
        key = f"{spec['level']}.{spec['loss'] or spec['entry']}: {outcome}"
        counts[key] = counts.get(key, 0) + 1

    try:
        if args.cases:  # one process for many given cases (compute-sanitizer's start-up is paid once)
            with open(args.cases) as f:
                for line in f:
                    if line.strip():
                        one(json.loads(line))
        else:
            from hypothesis import HealthCheck, given, seed, settings
            from hypothesis import strategies as st

            @seed(args.seed)
            @settings(max_examples=args.examples, deadline=None, database=None, print_blob=False,
                      suppress_health_check=list(HealthCheck))
            @given(specs(st, args.device))
            def fuzz(spec):
                one(spec)
            fuzz()
    finally:
        paths = sorted({path for path, _ in _jit.LAUNCHES})  # compiled / interpreted / eager launches seen
        print("FUZZ " + json.dumps({"cases": sum(counts.values()), "counts": counts, "launch_paths": paths}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

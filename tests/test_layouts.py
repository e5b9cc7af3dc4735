"""Layouts (issue 33): packed (padding-free) batches at every level, and the supervised tokens only at the
fused-linear level, against the padded layout and hk.reference.

Each case builds one batch three ways -- padded rows ``[B, T]`` (varied lengths, an empty sequence, an all-ignored
row, prompts ignored), the same sequences packed end to end (``Packed(cu_seqlens)``, TRL's padding-free layout)
and the supervised ranges ``[start, end)`` of each row (the completions) -- and checks loss, metrics and every
gradient against the padded call of the same level and the loss against hk.reference on the padded log-probs;
fused levels in the Triton interpreter and on the eager path, one chunk and small chunks. Then: the map built on
the device equals the host's, the GEMM flops scale with the supervised tokens, no host read, and the refusals.
"""
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import humanline_kernels as hk
from humanline_kernels import _layout as L

R = hk.reference
CLIP = hk.HumanlineClip(-1.2, 1.2)
V, D = 37, 8
# sequence lengths (DPO: chosen rows first); row 3 is empty, row 1's labels are all ignored
LENS = [7, 5, 6, 0, 9, 4]
PROMPT = [2, 1, 3, 0, 2, 1]  # leading positions of each row that are ignored (the prompt)


def _batch(seed=0, dtype=torch.float32):
    """Padded tensors, their packed twins, the boundaries and the supervised ranges."""
    g = torch.Generator().manual_seed(seed)
    S, T = len(LENS), max(LENS)
    h = torch.randn(S, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.7
    y = torch.randint(0, V, (S, T), generator=g)
    for s, (n, p) in enumerate(zip(LENS, PROMPT)):
        y[s, :p] = -100
        y[s, n:] = -100
    y[1] = -100
    y[4, 5] = -100  # a hole inside a completion: still inside its range
    logits = (h @ w.T).to(dtype)
    ref = torch.where(y != -100, R.token_logprobs(logits.float(), y) + 0.8 * torch.randn(S, T, generator=g), 0.0)
    cu = list(itertools.accumulate(LENS, initial=0))
    ranges = [[p, n] if n else [0, 0] for n, p in zip(LENS, PROMPT)]
    return dict(h=h.to(dtype), w=w.to(dtype), logits=logits, y=y, ref=ref, cu=cu, ranges=ranges,
                adv=torch.randn(S, generator=g), adv_tok=torch.randn(S, T, generator=g),
                des=torch.tensor([True, False, True, False, True, False]))


def pack(t):
    """A padded ``[S, T, ...]`` tensor as the packed stream ``[N, ...]`` of :data:`LENS`."""
    return torch.cat([t[s, :n] for s, n in enumerate(LENS)])


# name -> (function, keywords, per-token extras (names in the batch), per-sequence extras)
CASES = {
    "dpo": ("dpo", dict(clip=CLIP, beta=0.2), ["ref"], []),
    "dpo ipo no-clip": ("dpo", dict(clip=None, loss_type="ipo"), ["ref"], []),
    "dpo mixture ld": ("dpo", dict(clip=CLIP, loss_type=["sigmoid", "hinge"], loss_weights=[1.0, 0.5],
                                   ld_alpha=0.5), ["ref"], []),
    "kto": ("kto", dict(clip=CLIP, beta=0.3), ["ref"], ["des"]),
    "grpo": ("grpo", dict(clip=CLIP, beta=0.04), ["ref"], ["adv"]),
    "grpo token advantages": ("grpo", dict(clip=CLIP, loss_type="grpo"), ["ref", "adv_tok"], []),
    "sequence_logratios": ("sequence_logratios", dict(clip=CLIP, normalize=True), ["ref"], []),
    "ipo": ("ipo", dict(clip=CLIP, beta=0.2), ["ref"], []),
    "simpo": ("simpo", dict(clip=CLIP), [], []),
    "slic": ("slic", dict(clip=CLIP), [], []),
}
LOSSES_LEVEL = list(CASES)


def _scalar(name, out):
    if name == "sequence_logratios":
        return out[0].sum() + 0.5 * out[1].sum()
    return out[0]


def _metrics(name, out):
    return {} if name == "sequence_logratios" else {k: v for k, v in out[1].items()}


def _reference(case, b):
    """hk.reference's loss on the padded log-probs."""
    fn, kw, per_token, per_seq = CASES[case]
    lp = R.token_logprobs(b["logits"].float(), b["y"])
    mask = b["y"] != -100
    args = [b[k] for k in per_token]
    if fn == "grpo":
        adv = b["adv_tok"] if "adv_tok" in per_token else b["adv"]
        return _scalar(fn, getattr(R, fn)(lp, b["ref"], adv, mask, **kw))
    if fn in ("simpo", "slic"):
        return _scalar(fn, getattr(R, fn)(lp, mask, **kw))
    return _scalar(fn, getattr(R, fn)(lp, *args, mask, *[b[k] for k in per_seq], **kw))


def _call(level, case, b, layout, chunk_bytes=None):
    """``(loss, metrics, leaves)`` of one case at one level in one layout (``padded``, ``packed``, ``supervised``,
    ``packed+supervised``)."""
    fn, kw, per_token, per_seq = CASES[case]
    packed = "packed" in layout
    P = pack if packed else (lambda t: t)
    extra = dict(packed=hk.Packed(b["cu"])) if packed else {}
    if "supervised" in layout:
        extra["supervised"] = b["ranges"]
    tok = [P(b[k]) for k in per_token]
    seq = [b[k] for k in per_seq]
    if level == "losses":
        lp = P(R.token_logprobs(b["logits"].float(), b["y"])).detach().requires_grad_()
        mask = P(b["y"] != -100)
        if fn in ("simpo", "slic"):
            out = getattr(hk.losses, fn)(lp, mask, **kw, **extra)
        elif fn == "grpo":
            out = hk.losses.grpo(lp, tok[0], tok[1] if len(tok) > 1 else seq[0], mask, **kw, **extra)
        else:
            out = getattr(hk.losses, fn)(lp, *tok, mask, *seq, **kw, **extra)
        return _scalar(fn, out), _metrics(fn, out), (lp,)
    y = P(b["y"])
    if fn == "grpo":
        args = (tok[0], tok[1] if len(tok) > 1 else seq[0])
    else:
        args = (*tok, *seq)
    if level == "fused":
        x = P(b["logits"]).detach().clone().requires_grad_()
        out = getattr(hk.fused, fn)(x, y, *args, **kw, **extra)
        return _scalar(fn, out), _metrics(fn, out), (x,)
    h = P(b["h"]).detach().clone().requires_grad_()
    w = b["w"].detach().clone().requires_grad_()
    cb = {} if chunk_bytes is None else dict(chunk_bytes=chunk_bytes)
    out = getattr(hk.fused_linear, fn)(h, w, y, *args, **kw, **extra, **cb)
    return _scalar(fn, out), _metrics(fn, out), (h, w)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


def _compare(level, case, layout, b, tol, chunk_bytes=None):
    loss, met, leaves = _call(level, case, b, layout, chunk_bytes)
    loss0, met0, leaves0 = _call(level, case, b, "padded", chunk_bytes)
    torch.testing.assert_close(loss, loss0, rtol=tol, atol=tol)
    torch.testing.assert_close(loss.double(), _reference(case, b).double(), rtol=5 * tol + 1e-5, atol=5 * tol + 1e-5)
    for k in met0:
        torch.testing.assert_close(met[k].double(), met0[k].double(), rtol=tol, atol=tol, msg=k)
    g, g0 = _grads(loss, leaves), _grads(loss0, leaves0)
    first = g0[0] if "packed" not in layout else pack(g0[0])
    torch.testing.assert_close(g[0], first, rtol=tol, atol=tol)
    for a, a0 in zip(g[1:], g0[1:]):  # the lm_head weight
        torch.testing.assert_close(a, a0, rtol=tol, atol=tol)
    if "supervised" in layout and level == "fused_linear":  # outside the ranges: an exact 0 gradient
        inside = torch.zeros(len(LENS), max(LENS), dtype=torch.bool)
        for s, (a, e) in enumerate(b["ranges"]):
            inside[s, a:e] = True
        if "packed" in layout:
            inside = pack(inside)
        assert (g[0][~inside] == 0).all()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("case", LOSSES_LEVEL)
def test_losses_level_packed(case):
    _compare("losses", case, "packed", _batch(dtype=torch.float64), 1e-12)


@pytest.mark.parametrize("interp", ["1", "0"], ids=["interpreter", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_packed(case, interp, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    _compare("fused", case, "packed", _batch(), 1e-5)


@pytest.mark.parametrize("interp", ["1", "0"], ids=["interpreter", "eager"])
@pytest.mark.parametrize("layout", ["packed", "supervised", "packed+supervised"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_linear_layouts(case, layout, interp, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    _compare("fused_linear", case, layout, _batch(), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["packed", "supervised", "packed+supervised"])
@pytest.mark.parametrize("case", ["dpo", "kto", "grpo", "ipo"])
def test_fused_linear_layouts_in_small_chunks(case, layout, monkeypatch):
    """Chunks of one pair (DPO), one row (KTO) or two tokens (GRPO, the sums): the map's chunks keep a pair / row
    whole and the finalize spans right."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for chunk_bytes in (2 * V * 4, 9 * V * 4):
        _compare("fused_linear", case, layout, _batch(seed=1), 1e-5, chunk_bytes)


@pytest.mark.parametrize("case", ["dpo", "grpo", "kto"])
def test_bf16_packed_equals_padded(case, monkeypatch):
    """bf16 logits / hidden states: the packed and supervised calls compute the same rows as the padded one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    b = _batch(dtype=torch.bfloat16)
    for level, layouts in (("fused", ["packed"]), ("fused_linear", ["packed", "supervised"])):
        for layout in layouts:
            loss, _, leaves = _call(level, case, b, layout)
            loss0, _, leaves0 = _call(level, case, b, "padded")
            torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
            g, g0 = _grads(loss, leaves)[0], _grads(loss0, leaves0)[0]
            torch.testing.assert_close(g.float(), (pack(g0) if "packed" in layout else g0).float(), rtol=1e-2,
                                       atol=1e-3)


@pytest.mark.parametrize("interp", ["1", "0"], ids=["interpreter", "eager"])
@pytest.mark.parametrize("layout", ["supervised", "packed+supervised"])
def test_fused_linear_token_logprobs_supervised(layout, interp, monkeypatch):
    """Plain log-probs of the supervised positions only: equal to the dense call where a label is, 0 elsewhere;
    the gradient (through log-probs and entropy) too."""
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    b = _batch()
    packed = "packed" in layout
    P = pack if packed else (lambda t: t)
    extra = dict(supervised=b["ranges"], **(dict(packed=hk.Packed(b["cu"])) if packed else {}))
    h, h0 = P(b["h"]).clone().requires_grad_(), b["h"].clone().requires_grad_()
    for chunk_bytes in (1 << 20, 3 * V * 4):
        lp, ent = hk.fused_linear.token_logprobs(h, b["w"], P(b["y"]), return_entropy=True, chunk_bytes=chunk_bytes,
                                                 **extra)
        lp0, ent0 = hk.fused_linear.token_logprobs(h0, b["w"], b["y"], return_entropy=True)
        torch.testing.assert_close(lp, P(lp0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp, P(R.token_logprobs(b["logits"], b["y"])), rtol=1e-5, atol=1e-5)
        (g,) = torch.autograd.grad(lp.sum() + 0.1 * ent.sum(), h)
        (g0,) = torch.autograd.grad(lp0.sum() + 0.1 * torch.where(b["y"] != -100, ent0, 0.0).sum(), h0)
        torch.testing.assert_close(g, P(g0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opts, inputs", [
    (dict(loss_type="cispo"), ("importance_sampling_ratio", "tool_mask")),
    (dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04, use_bias_correction_kl=True),
     ("tool_mask",)),
    (dict(loss_type="sapo", entropy_coef=0.01), ("entropies", "importance_sampling_ratio")),
    (dict(loss_type="dapo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.3),
     ("entropies", "sampling_per_token_logps")),
])
def test_losses_grpo_packed_with_per_token_options(opts, inputs):
    """hk.losses.grpo with TRL's per-token inputs (vLLM importance weight, tool mask, sampling log-probs, entropies,
    token advantages) packed: every one moved to the padded rows, the loss and gradients of the padded call."""
    b = _batch(seed=4, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    S, T = b["y"].shape
    lp0 = R.token_logprobs(b["logits"].double(), b["y"])
    mask = b["y"] != -100
    per_token = dict(importance_sampling_ratio=torch.rand(S, T, generator=g, dtype=torch.float64) + 0.5,
                     tool_mask=torch.rand(S, T, generator=g) > 0.2,
                     sampling_per_token_logps=lp0 - 0.1 * torch.rand(S, T, generator=g, dtype=torch.float64),
                     entropies=torch.rand(S, T, generator=g, dtype=torch.float64) * 2)
    per_token = {k: v for k, v in per_token.items() if k in inputs}
    adv = b["adv_tok"].double()
    ent = per_token.get("entropies", torch.zeros(S, T, dtype=torch.float64))
    ent_leaf0, ent_leaf = ent.clone().requires_grad_(), pack(ent).clone().requires_grad_()
    lpa, lpb = lp0.clone().requires_grad_(), pack(lp0).clone().requires_grad_()
    kw0 = dict(per_token)
    kw1 = {k: pack(v) for k, v in per_token.items()}
    if "entropies" in per_token:
        kw0["entropies"], kw1["entropies"] = ent_leaf0, ent_leaf
    a = hk.losses.grpo(lpa, b["ref"].double(), adv, mask, clip=CLIP, **kw0, **opts)
    c = hk.losses.grpo(lpb, pack(b["ref"].double()), pack(adv), pack(mask), clip=CLIP, packed=hk.Packed(b["cu"]),
                       **kw1, **opts)
    torch.testing.assert_close(c[0], a[0])
    for k in a[1]:
        torch.testing.assert_close(c[1][k], a[1][k], msg=k)
    ga = torch.autograd.grad(a[0], (lpa, ent_leaf0), allow_unused=True)
    gc = torch.autograd.grad(c[0], (lpb, ent_leaf), allow_unused=True)
    for x, y in zip(gc, ga):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, pack(y))


def test_kto_kl_rows_packed():
    """KTO's KL rows packed with boundaries of their own (``kl_packed``) give the padded rows' baseline."""
    b = _batch(dtype=torch.float64)
    lp = R.token_logprobs(b["logits"].double(), b["y"])
    mask = b["y"] != -100
    kl = (lp[:4] + 0.2, b["ref"][:4].double(), mask[:4])
    cu_kl = b["cu"][:5]
    kl_packed = [torch.cat([t[s, :n] for s, n in enumerate(LENS[:4])]) for t in kl]
    args = (lp, b["ref"].double(), mask, b["des"])
    for kl_estimate in ("halos", "trl"):
        a = hk.losses.kto(*args, *kl_packed, kl_packed=hk.Packed(cu_kl), kl_estimate=kl_estimate)
        e = hk.losses.kto(*args, *kl, kl_estimate=kl_estimate)
        torch.testing.assert_close(a[0], e[0])
        torch.testing.assert_close(a[1]["kl"], e[1]["kl"])
        r = R.kto(*args, *kl, kl_estimate=kl_estimate)
        torch.testing.assert_close(a[0], r[0])


def test_device_map_equals_host_map():
    """``cu_seqlens`` as a tensor with ``max_seqlen``: the map is built with tensor ops (no host read), equal to the
    one built from host integers; ``from_position_ids`` reads TRL's restarting positions."""
    b = _batch()
    N = b["cu"][-1]
    host = L.packed_map(hk.Packed(b["cu"]), N, torch.device("cpu"))
    dev = L.packed_map(hk.Packed(torch.tensor(b["cu"], dtype=torch.int32), max(LENS)), N, torch.device("cpu"))
    assert host.rows is not None and dev.rows is None
    assert (host.S, host.T) == (dev.S, dev.T) and torch.equal(host.plane, dev.plane)
    pos = torch.cat([torch.arange(n) for n in LENS if n])
    pk = hk.Packed.from_position_ids(pos.unsqueeze(0))
    assert pk.max_seqlen == max(LENS)
    assert pk.host_cu() == sorted(set(b["cu"]))  # (the empty sequence leaves no position to find)


def test_dpo_map_keeps_pairs_together():
    """DPO's map lists row j, then its partner P + j; a chunk never splits a pair, even with an empty row."""
    b = _batch()
    tm = L.supervised_map(b["ranges"], len(LENS), max(LENS), torch.device("cpu"), pairs=True)
    assert tm.rows == [0, 3, 1, 4, 2, 5]
    from humanline_kernels.ops import linear as LC
    for max_rows in (1, 5, 9, 100):
        chunks = LC.map_chunks("dpo", tm, max_rows)
        spans = [c.span for c in chunks]
        assert spans[0][0] == 0 and spans[-1][1] == 3 and all(a[1] == c[0] for a, c in zip(spans, spans[1:]))
        assert sum(c.n for c in chunks) == tm.M


class _Flops(TorchDispatchMode):
    """Counts the multiply-adds of every matrix product dispatched (``2 m n k`` flops each)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_"):
            a, c = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * c.shape[1]
        return func(*args, **kwargs)


@pytest.mark.parametrize("fn", ["dpo", "grpo", "kto"])
def test_gemm_flops_scale_with_supervised_tokens(fn, monkeypatch):
    """Counted on CPU: the lm_head GEMMs of a fused-linear loss (forward + backward) issue 6 D V flops per
    computed position -- all B T positions dense, only the supervised ones with ``supervised``. The GEMMs are the
    host code's, the same whichever twin runs the per-token kernels, so the eager one runs them (the interpreted
    ones are checked against the reference above)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    g = torch.Generator().manual_seed(3)
    B, T = 4, 32
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    ref = torch.randn(B, T, generator=g) - 3
    extra = {"dpo": (), "grpo": (torch.randn(B, generator=g),), "kto": (torch.tensor([True, False, True, False]),)}
    counts = {}
    for frac in (0.0, 0.5, 0.75):
        start = int(T * frac)
        y = torch.randint(0, V, (B, T), generator=g)
        y[:, :start] = -100
        for mode in ("dense", "supervised"):
            kw = dict(supervised=[[start, T]] * B) if mode == "supervised" else {}
            with _Flops() as f:
                loss = getattr(hk.fused_linear, fn)(h, w, y, ref, *extra[fn], **kw)[0]
                loss.backward()
            counts[frac, mode] = f.flops
    dense = 6 * B * T * D * V
    for frac in (0.0, 0.5, 0.75):
        assert counts[frac, "dense"] == dense
        assert counts[frac, "supervised"] == round(dense * (1 - frac))


def test_no_host_reads(monkeypatch):
    """Host-side boundaries and ranges (Python lists) and tensor boundaries with ``max_seqlen``: a packed or
    supervised call reads no tensor value on the host."""
    from test_no_host_sync import no_host_reads
    b = _batch()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cu_t = torch.tensor(b["cu"])
    x = pack(b["logits"]).requires_grad_()
    h = b["h"].clone().requires_grad_()
    with no_host_reads(monkeypatch):
        loss = hk.fused.dpo(x, pack(b["y"]), pack(b["ref"]), packed=hk.Packed(cu_t, max(LENS)))[0]
        loss.backward()
        loss = hk.fused.grpo(x, pack(b["y"]), pack(b["ref"]), b["adv"], packed=hk.Packed(b["cu"]))[0]
        loss.backward()
        loss = hk.fused_linear.dpo(h, b["w"], b["y"], b["ref"], supervised=b["ranges"])[0]
        loss.backward()


def test_refusals():
    b = _batch()
    x, y, ref = pack(b["logits"]), pack(b["y"]), pack(b["ref"])
    with pytest.raises(ValueError, match="packed must be a humanline_kernels.Packed"):
        hk.fused.dpo(x, y, ref, packed=b["cu"])
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        hk.fused.dpo(x, y, ref, packed=hk.Packed([1] + b["cu"][1:]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        hk.fused.dpo(x, y, ref, packed=hk.Packed(b["cu"][:-1] + [b["cu"][-1] + 1]))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
        hk.Packed(torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match=r"logits must have shape \[N, V\] or \[1, N, V\]"):
        hk.fused.dpo(b["logits"], b["y"], b["ref"], packed=hk.Packed(b["cu"]))
    with pytest.raises(ValueError, match="max_seqlen"):
        hk.Packed(b["cu"], max_seqlen=-1)
    with pytest.raises(ValueError, match="position 0"):
        hk.Packed.from_position_ids(torch.tensor([1, 2, 0, 1]))
    for bad in (torch.tensor([0.0, 1.0, 0.0]), torch.tensor([False, True, False])):  # (read as starts at 0 before)
        with pytest.raises(ValueError, match="position_ids must hold integers, got dtype"):
            hk.Packed.from_position_ids(bad)
    h, w = b["h"], b["w"]
    with pytest.raises(ValueError, match=r"one \[start, end\) range per row"):
        hk.fused_linear.dpo(h, w, b["y"], b["ref"], supervised=b["ranges"][:-1])
    with pytest.raises(ValueError, match="0 <= start <= end"):
        hk.fused_linear.dpo(h, w, b["y"], b["ref"], supervised=[[0, 99]] * len(LENS))
    short = [[a + 1 if e > a else a, e] for a, e in b["ranges"]]  # misses each completion's first label
    with pytest.raises(ValueError, match="labels outside the supervised ranges"):
        hk.fused_linear.dpo(h, w, b["y"], b["ref"], supervised=short)
    hk.fused_linear.dpo(h, w, b["y"], b["ref"], supervised=short, validate=False)  # (then outside is ignored)

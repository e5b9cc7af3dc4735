"""Every bad input of docs/design.md raises a ValueError naming the argument, before any work is done."""
import math

import pytest
import torch

import humanline_kernels as hk


def _lp(B=2, T=3):
    return torch.randn(B, T), torch.randn(B, T), torch.ones(B, T, dtype=torch.bool)


def test_clip_band_reversed():
    with pytest.raises(ValueError, match="log_eps_p"):
        hk.HumanlineClip(log_eps_p=1.0, log_eps_r=-1.0)


def test_clip_nan():
    with pytest.raises(ValueError, match="log_eps_r"):
        hk.HumanlineClip(log_eps_r=float("nan"))


def test_clip_wrong_type():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="clip"):
        hk.losses.dpo(lp, ref, m, clip=(-1.0, 1.0))


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_odd_dpo_rows(level):
    lp, ref, m = _lp(B=3)
    with pytest.raises(ValueError, match="even"):
        level.dpo(lp, ref, m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_ref_logps_wrong_shape(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="ref_logps"):
        level.dpo(lp, ref[:, :2], m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_logps_not_2d(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="logps"):
        level.grpo(lp[0], ref[0], torch.ones(2), m[0])


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_mask_not_bool(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="mask"):
        level.dpo(lp, ref, m.float())


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_logps_dtype_mismatch(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="ref_logps"):
        level.dpo(lp, ref.double(), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_logps_half_dtype(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="logps"):
        level.dpo(lp.half(), ref.half(), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_device_mismatch(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="device"):
        level.dpo(lp, ref.to("meta"), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_advantages_wrong_shape(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="advantages"):
        level.grpo(lp, ref, torch.ones(3), m)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_unknown_loss_type(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="loss_type"):
        level.grpo(lp, ref, torch.ones(2), m, loss_type="sum")


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_kto_desirable_not_bool(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="desirable"):
        level.kto(lp, ref, m, torch.ones(2))


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_kto_partial_kl_inputs(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="kl_logps"):
        level.kto(lp, ref, m, torch.ones(2, dtype=torch.bool), lp, None, None)


@pytest.mark.parametrize("level", [hk.reference, hk.losses])
def test_negative_beta(level):
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="beta"):
        level.dpo(lp, ref, m, beta=-0.1)


def test_label_smoothing_out_of_range():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="label_smoothing"):
        hk.losses.dpo(lp, ref, m, label_smoothing=0.7)


def test_epsilon_out_of_range():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="epsilon_low"):
        hk.losses.grpo(lp, ref, torch.ones(2), m, epsilon_low=1.5)


def test_max_completion_length_invalid():
    lp, ref, m = _lp()
    with pytest.raises(ValueError, match="max_completion_length"):
        hk.losses.grpo(lp, ref, torch.ones(2), m, loss_type="dr_grpo", max_completion_length=0)


# --- logits level -----------------------------------------------------------------------------------------------

LOGITS_FNS = {
    "token_logprobs": lambda lg, lab, **kw: hk.token_logprobs(lg, lab, **kw),
    "reference": lambda lg, lab, **kw: hk.reference.token_logprobs(lg, lab, **kw),
    "fused.dpo": lambda lg, lab, **kw: hk.fused.dpo(lg, lab, torch.zeros(lab.shape), **kw),
    "fused.grpo": lambda lg, lab, **kw: hk.fused.grpo(lg, lab, torch.zeros(lab.shape), torch.ones(lab.shape[0]), **kw),
}


@pytest.fixture(params=list(LOGITS_FNS), ids=list(LOGITS_FNS))
def fn(request):
    return LOGITS_FNS[request.param]


def test_labels_out_of_range(fn):
    lg, lab = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    lab[1, 2] = 5
    with pytest.raises(ValueError, match="labels"):
        fn(lg, lab)


def test_labels_negative_not_ignore_index(fn):
    lg, lab = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    lab[0, 0] = -1
    with pytest.raises(ValueError, match="labels"):
        fn(lg, lab)


def test_labels_wrong_dtype(fn):
    with pytest.raises(ValueError, match="labels"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.int32))


def test_labels_wrong_shape(fn):
    with pytest.raises(ValueError, match="labels"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_logits_noncontiguous_last_dim(fn):
    lg = torch.randn(2, 5, 3).transpose(1, 2)  # [2, 3, 5] with last stride 3
    with pytest.raises(ValueError, match="contiguous last dimension"):
        fn(lg, torch.zeros(2, 3, dtype=torch.long))


def test_logits_integer_dtype(fn):
    with pytest.raises(ValueError, match="logits"):
        fn(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


def test_logits_labels_device_mismatch(fn):
    with pytest.raises(ValueError, match="device"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long, device="meta"))


def test_temperature_nonpositive(fn):
    with pytest.raises(ValueError, match="temperature"):
        fn(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


def test_validate_false_skips_only_the_range_check():
    # validate=False must not sync: an out-of-range label is then the caller's promise, shape checks still run
    lg, lab = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    hk.token_logprobs(lg, lab, validate=False)
    with pytest.raises(ValueError, match="labels"):
        hk.token_logprobs(lg, lab[:, :2], validate=False)


def test_fused_ref_logps_wrong_shape():
    with pytest.raises(ValueError, match="ref_logps"):
        hk.fused.dpo(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 2))


def test_fused_odd_dpo_rows():
    with pytest.raises(ValueError, match="even"):
        hk.fused.dpo(torch.randn(3, 3, 5), torch.zeros(3, 3, dtype=torch.long), torch.zeros(3, 3))


def test_nan_logits_propagate_as_nan():
    lg = torch.randn(2, 3, 5)
    lg[0, 1, 2] = float("nan")
    lab = torch.zeros(2, 3, dtype=torch.long)
    loss, _ = hk.fused.dpo(lg, lab, torch.zeros(2, 3))
    assert torch.isnan(loss)


# --- issue 52: bad input never corrupts memory, never returns a refused number, never drops a gradient ---------------

def _packed_batch(seed=0, lens=(3, 5, 2), V=7):
    g = torch.Generator().manual_seed(seed)
    N = sum(lens)
    return (torch.randn(N, V, generator=g), torch.randint(0, V, (N,), generator=g), torch.randn(N, generator=g),
            list(lens))


@pytest.mark.parametrize("cu, why", [([2, 5, 10], "first boundary not 0"), ([0, 5, 3, 10], "decreasing"),
                                     ([0, 3, 8, 9], "not ending at N"), ([0, 1, 9, 10], "longer than max_seqlen")])
@pytest.mark.parametrize("level", ["fused", "losses"])
def test_tensor_cu_seqlens_are_checked(cu, why, level):
    """Boundaries given as a tensor with max_seqlen (the device path, no host sync): every rule of the host list's,
    a ValueError on a CPU tensor, as every other input check (issue 52: a first boundary != 0 wrote before the
    start of a buffer and aborted the process; decreasing ones returned a loss)."""
    x, y, ref, _ = _packed_batch(lens=(3, 5, 2))
    packed = hk.Packed(torch.tensor(cu), max_seqlen=5)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease, end at the 10 packed"):
        if level == "fused":
            hk.fused.grpo(x, y, ref, torch.ones(len(cu) - 1), packed=packed)
        else:
            hk.losses.grpo(ref, ref, torch.ones(len(cu) - 1), y >= 0, packed=packed)


def test_host_cu_seqlens_honour_max_seqlen():
    x, y, ref, lens = _packed_batch()
    with pytest.raises(ValueError, match="max_seqlen=4 is shorter than the longest packed sequence"):
        hk.fused.dpo(x[:8], y[:8], ref[:8], packed=hk.Packed([0, 3, 8], max_seqlen=4))
    with pytest.raises(ValueError, match="max_seqlen must be a non-negative int"):
        hk.Packed([0, 3], max_seqlen=True)
    with pytest.raises(ValueError, match="sequence of ints"):
        hk.Packed([0, 2.5, 5])


@pytest.mark.parametrize("cu", [[2, 5, 10], [0, 5, 3, 10], [0, 1, 9, 10], [-4, 9, 10], [0, 30, 10]])
@pytest.mark.parametrize("interp", ["1", "0"], ids=["interpreter", "eager"])
def test_unchecked_boundaries_stay_inside_the_buffers(cu, interp, monkeypatch):
    """validate=False skips the device check of tensor boundaries: the map then clamps every position into its
    sequence's row and the kernels clamp every map entry into the planes, so a broken layout gives an unspecified
    result, never an access outside a buffer (the interpreter and the guard elements around the inputs would show
    one)."""
    monkeypatch.setenv("TRITON_INTERPRET", interp)
    x, y, ref, _ = _packed_batch()
    G = 64
    buf = torch.full((G + x.numel() + G,), -7.25e3)
    buf[G:G + x.numel()] = x.reshape(-1)
    xg = buf[G:G + x.numel()].view(x.shape).requires_grad_()
    packed = hk.Packed(torch.tensor(cu), max_seqlen=5)
    loss = hk.fused.grpo(xg, y, ref, torch.ones(len(cu) - 1), packed=packed, validate=False, beta=0.04)[0]
    loss.backward()
    s, pol, _ = hk.fused.sequence_logratios(xg, y, ref, packed=packed, validate=False)
    (s.sum() + pol.sum()).backward()
    assert (buf[:G] == -7.25e3).all() and (buf[G + x.numel():] == -7.25e3).all()
    torch.testing.assert_close(xg.detach(), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unchecked_labels_outside_the_vocabulary_give_nan(dtype):
    """validate=False with a label outside [0, V): the row kernels (fp32) and the eager path (fp64 logits) do not read
    outside the row (the label is masked) and the log-prob is NaN, so is the loss; hk.reference agrees. (On CUDA
    the eager path's gather of such a label was a device-side assert that ended the context: run 5's CUDA fuzz.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 5, (2, 3), generator=g)
    y[0, 1], y[1, 2] = 5, -7
    for lp in (hk.token_logprobs(x, y, validate=False), hk.reference.token_logprobs(x, y, validate=False)):
        assert torch.isnan(lp[0, 1]) and torch.isnan(lp[1, 2]) and torch.isfinite(lp[1, :2]).all()
    loss = hk.fused.dpo(x, y, torch.zeros(2, 3, dtype=dtype), validate=False)[0]
    assert torch.isnan(loss)
    loss.backward()  # (no access outside the logits either)


def _grad_case(level, name, **kw):
    """``(call, reference)`` taking the leaves ``(x, ref, adv, kl_ref, norm)`` of one loss."""
    g = torch.Generator().manual_seed(3)
    B, T, V, D = 4, 5, 11, 6
    h, W = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[1, :2] = -100
    logits = h @ W.T
    lp0 = hk.reference.token_logprobs(logits, y).detach()
    data = dict(ref=lp0 + torch.randn(B, T, generator=g), adv=torch.randn(B, generator=g),
                kl=lp0 + 0.5 * torch.randn(B, T, generator=g), norm=torch.tensor(7.0))
    x = logits if level == "fused" else h
    args = (x,) if level == "fused" else (x, W)
    mod = getattr(hk, level)
    clip = hk.HumanlineClip(-0.8, 0.6)
    des = torch.tensor([True, False, True, True])

    def call(x, ref, adv, kl, norm):
        a = (*args[:-1], x) if level == "fused" else (x, W)
        if name == "grpo":
            return mod.grpo(*a, y, ref, adv, kl_ref_logps=kl, normalizer=norm, clip=clip, beta=0.05, **kw)[0]
        if name == "kto":
            return mod.kto(*a, y, ref, des, clip=clip)[0]
        return getattr(mod, name)(*a, y, ref, clip=clip, **kw)[0]

    def reference(x, ref, adv, kl, norm):
        lp = hk.reference.token_logprobs(x if level == "fused" else x @ W.T, y)
        m = y != -100
        if name == "grpo":
            return hk.reference.grpo(lp, ref, adv, m, kl_ref_logps=kl, normalizer=norm, clip=clip, beta=0.05)[0]
        if name == "kto":
            return hk.reference.kto(lp, ref, m, des, clip=clip)[0]
        r = getattr(hk.reference, name)(lp, ref, m, clip=clip, **kw)
        return r[0] if name != "sequence_logratios" else r[0].sum()
    return call, reference, x, data


@pytest.mark.parametrize("level", ["fused", "fused_linear"])
@pytest.mark.parametrize("name, kw", [("dpo", {}), ("dpo", dict(loss_type="hinge")), ("kto", {}), ("ipo", {}),
                                      ("grpo", {}), ("grpo", dict(grad_in_forward=True)),
                                      ("sequence_logratios", {})], ids=str)
def test_reference_and_advantages_receive_their_gradient(level, name, kw):
    """On the kernel path, a reference that requires grad (a reference being trained), advantages (a learned
    baseline), a separate KL reference and a tensor normalizer get the gradient hk.reference gives them (issue 52:
    .grad stayed None)."""
    if level == "fused_linear" and kw.get("grad_in_forward"):
        pytest.skip("a logits-level keyword")
    call, reference, x, data = _grad_case(level, name, **kw)
    leaves = [x] + [data[k] for k in ("ref", "adv", "kl", "norm")]
    used = [True, True] + [name == "grpo"] * 3
    got_in = [t.clone().requires_grad_(u) for t, u in zip(leaves, used)]
    want_in = [t.clone().requires_grad_(u) for t, u in zip(leaves, used)]
    loss = call(*[t if u else None for t, u in zip(got_in, used)])
    if name == "sequence_logratios":
        loss = loss.sum()
    want = reference(*[t if u else None for t, u in zip(want_in, used)])
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    names = [n for n, u in zip(["x", "ref_logps", "advantages", "kl_ref_logps", "normalizer"], used) if u]
    got = torch.autograd.grad(loss, [t for t, u in zip(got_in, used) if u])  # (one backward: grad_in_forward's)
    want = torch.autograd.grad(want, [t for t, u in zip(want_in, used) if u])
    for n, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("level", ["fused", "fused_linear"])
@pytest.mark.parametrize("name", ["dpo", "kto", "grpo", "ipo"])
def test_ref_logps_none_is_refused_by_name(level, name):
    x = torch.randn(2, 3, 5) if level == "fused" else torch.randn(2, 3, 4)
    args = (x,) if level == "fused" else (x, torch.randn(5, 4))
    y = torch.zeros(2, 3, dtype=torch.long)
    extra = {"grpo": (torch.ones(2),), "kto": (torch.tensor([True, False]),)}.get(name, ())
    with pytest.raises(ValueError, match="ref_logps must be a torch.Tensor"):
        getattr(getattr(hk, level), name)(*args, y, None, *extra)
    s, pol, _ = getattr(hk, level).sequence_logratios(*args, y, None)  # None: a reference of 0
    assert s.shape == pol.shape == (2,)


@pytest.mark.parametrize("level", ["fused", "fused_linear"])
def test_wpo_refusal_names_what_the_level_takes(level):
    x = torch.randn(2, 3, 5) if level == "fused" else torch.randn(2, 3, 4)
    args = (x,) if level == "fused" else (x, torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"use_weighting=True \(WPO\) .* use hk.losses.dpo, which takes it as "
                                         "log_sum_sq_probs"):
        getattr(hk, level).dpo(*args, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), use_weighting=True)


@pytest.mark.parametrize("band", [(0.5, 1.0), (-1.0, -0.2), (0.1, 0.1)])
def test_clip_band_without_zero_is_refused(band):
    with pytest.raises(ValueError, match="log_eps_p <= 0 <= log_eps_r"):
        hk.HumanlineClip(*band)
    hk.HumanlineClip(0.0, 0.0)  # (a band at 0 holds it)


def test_packed_advantages_one_per_sequence_when_n_equals_s():
    """A packed batch of S sequences with N == S positions: advantages [S] are one per sequence (found by the fuzz:
    they were read as one per token), per token they are [1, N]."""
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.7])
    ref, mask = lp + torch.tensor([0.1, -0.3, 0.2, 0.05]), torch.ones(4, dtype=torch.bool)
    cu = [0, 1, 1, 3, 4]  # lengths 1, 0, 2, 1
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    pad = torch.zeros(4, 2)
    pad[0, 0], pad[2, :2], pad[3, 0] = lp[0], lp[1:3], lp[3]
    rpad = torch.zeros(4, 2)
    rpad[0, 0], rpad[2, :2], rpad[3, 0] = ref[0], ref[1:3], ref[3]
    mpad = pad != 0
    want = hk.reference.grpo(pad, rpad, adv, mpad)[0]
    got = hk.losses.grpo(lp, ref, adv, mask, packed=hk.Packed(cu))[0]
    torch.testing.assert_close(got, want)
    tok = torch.tensor([1.0, 2.0, -1.0, 0.5])
    atok = torch.zeros(4, 2)
    atok[0, 0], atok[2, :2], atok[3, 0] = tok[0], tok[1:3], tok[3]
    torch.testing.assert_close(hk.losses.grpo(lp, ref, tok[None], mask, packed=hk.Packed(cu))[0],
                               hk.reference.grpo(pad, rpad, atok, mpad)[0])


def test_fused_linear_fp64_hidden_with_fp32_reference_in_chunks(monkeypatch):
    """fp64 hidden states (the eager twins) with an fp32 reference over several chunks (found by the fuzz: a dtype
    error writing the chunks' planes)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(2, 4, 3, dtype=torch.float64, generator=g), torch.randn(5, 3, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (2, 4), generator=g)
    ref = torch.randn(2, 4, generator=g)
    loss = hk.fused_linear.kto(h, W, y, ref, torch.tensor([True, False]), chunk_bytes=4 * 5 * 8)[0]  # a row a chunk
    lp = hk.reference.token_logprobs(h @ W.T, y).float()
    torch.testing.assert_close(loss.float(), hk.reference.kto(lp, ref, y >= 0, torch.tensor([True, False]))[0])


def test_supervised_ranges_all_empty(monkeypatch):
    """Supervised ranges without a position (found by the fuzz: a TypeError gathering no hidden rows)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    h, W = torch.randn(1, 2, 3, requires_grad=True), torch.randn(5, 3)
    y = torch.full((1, 2), -100)
    s, pol, _ = hk.fused_linear.sequence_logratios(h, W, y, torch.zeros(1, 2), supervised=[[0, 0]])
    assert s.tolist() == [0.0] and pol.tolist() == [0.0]


def test_malformed_tensors_are_refused_before_anything_runs():
    """A list where a tensor goes, at the layouts' own checks (found by the fuzz: AttributeError from inside)."""
    x, y, ref, lens = _packed_batch()
    with pytest.raises(ValueError, match="logits must have shape"):
        hk.fused.dpo(x.tolist(), y, ref, packed=hk.Packed([0, 4, 10]))
    with pytest.raises(ValueError, match="hidden must be a torch.Tensor"):
        hk.fused_linear.grpo(None, torch.randn(7, 4), y[None], ref[None], torch.ones(1))
    with pytest.raises(ValueError, match="ref_logps must be a torch.Tensor"):
        hk.losses.dpo(ref[:4], ref[:4].tolist(), y[:4] >= 0, packed=hk.Packed([0, 2, 4]))


# --- the clip band's ends: -inf / inf (no bound on that side) or finite within float32's range ----------------------

F32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("band, name", [((-1e300, 1e300), "log_eps_p"), ((-1.0, 1e300), "log_eps_r"),
                                        ((-3.5e38, 1.0), "log_eps_p"), ((0.0, 3.5e38), "log_eps_r")])
def test_clip_end_beyond_float32_is_refused(band, name):
    """A finite end float32 cannot hold became inf in the kernels and an overflow RuntimeError in hk.losses and
    hk.reference: refused where the band is built, so every path (and every config that builds one) agrees."""
    with pytest.raises(ValueError, match=f"{name} must be -inf, inf .* within float32's range"):
        hk.HumanlineClip(*band)


def test_clip_ends_at_float32_max_run_everywhere():
    lp, ref, m = _lp()
    c = hk.HumanlineClip(-F32_MAX, F32_MAX)
    want = hk.reference.dpo(lp, ref, m, clip=None)[0]
    for level in (hk.reference, hk.losses):
        torch.testing.assert_close(level.dpo(lp, ref, m, clip=c)[0], want)


def _inf_band_case(name, dtype):
    g = torch.Generator().manual_seed(5)
    B, T, V, D = 4, 5, 11, 6
    h, W = torch.randn(B, T, D, generator=g, dtype=dtype), torch.randn(V, D, generator=g, dtype=dtype)
    y = torch.randint(0, V, (B, T), generator=g)
    y[1, :2] = -100
    ref = hk.reference.token_logprobs(h @ W.T, y).float().detach() + 2 * torch.randn(B, T, generator=g)
    extra = {"grpo": (torch.randn(B, generator=g),), "kto": (torch.tensor([True, False, True, True]),)}.get(name, ())
    return h, W, y, ref, extra


@pytest.mark.parametrize("band", [(-math.inf, math.inf), (-math.inf, 0.5), (-0.5, math.inf)], ids=str)
@pytest.mark.parametrize("name", ["dpo", "kto", "grpo"])
@pytest.mark.parametrize("path", ["kernels", "eager"])
def test_clip_infinite_end_is_no_bound_on_that_side(band, name, path, monkeypatch):
    """-inf / inf: no bound on that side, on every level and path: the loss, the metrics and the gradient of
    hk.reference with the same band, and with both ends infinite those of the plain objective (clip=None)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if path == "kernels" else "0")
    h, W, y, ref, extra = _inf_band_case(name, torch.float32)
    c = hk.HumanlineClip(*band)
    m = y != -100

    def reference(h, clip):
        lp = hk.reference.token_logprobs(h @ W.T, y)
        per_token = (extra[0], m) if name == "grpo" else (m, *extra)
        return getattr(hk.reference, name)(lp, ref, *per_token, clip=clip)

    def levels(h):
        lp = hk.reference.token_logprobs(h @ W.T, y)
        per_token = (extra[0], m) if name == "grpo" else (m, *extra)
        yield "losses", getattr(hk.losses, name)(lp, ref, *per_token, clip=c)
        yield "fused", getattr(hk.fused, name)(h @ W.T, y, ref, *extra, clip=c)
        yield "fused_linear", getattr(hk.fused_linear, name)(h, W, y, ref, *extra, clip=c)

    hw = h.clone().requires_grad_()
    want, want_met = reference(hw, c)
    (want_g,) = torch.autograd.grad(want, hw)
    if band == (-math.inf, math.inf):
        plain, plain_met = reference(h, None)
        torch.testing.assert_close(want, plain)
        assert want_met["unclipped_frac"] == plain_met["unclipped_frac"] == 1.0
    hg = h.clone().requires_grad_()
    for level, (loss, met) in levels(hg):
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=level)
        for k, v in want_met.items():
            torch.testing.assert_close(met[k], v, rtol=1e-5, atol=1e-6, msg=f"{level} {k}")
        (g,) = torch.autograd.grad(loss, hg)
        torch.testing.assert_close(g, want_g, rtol=1e-4, atol=1e-6, msg=level)


@pytest.mark.parametrize("field, value", [("log_eps_r", 1e300), ("log_eps_p", -1e39)])
@pytest.mark.parametrize("config", ["HumanlineDPOConfig", "HumanlineKTOConfig", "HumanlineGRPOConfig"])
def test_trl_configs_refuse_a_clip_end_beyond_float32(config, field, value, tmp_path):
    """The TRL configs build the band at construction: refused there, not at the first training step."""
    trl = pytest.importorskip("humanline_kernels.integrations.trl")
    cls = getattr(trl, config)
    with pytest.raises(ValueError, match=f"{field} must be -inf, inf"):
        cls(str(tmp_path), use_cpu=True, report_to=[], **{field: value})
    c = cls(str(tmp_path), use_cpu=True, report_to=[], log_eps_r=math.inf)  # (no bound above: accepted)
    assert c.log_eps_r == math.inf


# --- the hidden level's shapes ---------------------------------------------------------------------------------------

LINEAR_FNS = {
    "token_logprobs": lambda h, W, y: hk.fused_linear.token_logprobs(h, W, y),
    "token_logprobs_nograd": lambda h, W, y: hk.fused_linear.token_logprobs_nograd(h, W, y),
    "dpo": lambda h, W, y: hk.fused_linear.dpo(h, W, y, torch.zeros(y.shape)),
    "kto": lambda h, W, y: hk.fused_linear.kto(h, W, y, torch.zeros(y.shape), torch.tensor([True, False])),
    "grpo": lambda h, W, y: hk.fused_linear.grpo(h, W, y, torch.zeros(y.shape), torch.ones(2)),
    "sequence_logratios": lambda h, W, y: hk.fused_linear.sequence_logratios(h, W, y, torch.zeros(y.shape)),
    "ipo": lambda h, W, y: hk.fused_linear.ipo(h, W, y, torch.zeros(y.shape)),
    "simpo": lambda h, W, y: hk.fused_linear.simpo(h, W, y),
    "slic": lambda h, W, y: hk.fused_linear.slic(h, W, y),
}


@pytest.mark.parametrize("fn", list(LINEAR_FNS))
def test_hidden_size_zero_is_refused_by_name(fn):
    """D = 0 (as V = 0 already was): a raw reshape error from inside the chunk loop before."""
    y = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden must have a non-empty hidden dimension"):
        LINEAR_FNS[fn](torch.randn(2, 3, 0), torch.randn(5, 0), y)
    with pytest.raises(ValueError, match=r"weight must have a non-empty vocabulary dimension"):
        LINEAR_FNS[fn](torch.randn(2, 3, 4), torch.randn(0, 4), y)


# --- packed layouts: the same answer at every level ------------------------------------------------------------------

def _stream(N=7, D=4, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, D, generator=g), torch.randn(V, D, generator=g), torch.randint(0, V, (N,), generator=g),
            torch.randn(N, generator=g))


def test_packed_as_a_list_is_refused_by_name_at_every_level():
    """hk.fused_linear.token_logprobs took packed=[...] to an AttributeError from inside the supervised map; every
    level refuses a list by name (hk.Packed takes the list)."""
    h, W, y, lp = _stream(N=6)
    calls = {
        "fused_linear.token_logprobs": lambda: hk.fused_linear.token_logprobs(h, W, y, supervised=[[0, 3], [0, 3]],
                                                                              packed=[0, 3, 6]),
        "fused_linear.token_logprobs (dense)": lambda: hk.fused_linear.token_logprobs(h, W, y, packed=[0, 3, 6]),
        "fused_linear.dpo": lambda: hk.fused_linear.dpo(h, W, y, lp, packed=[0, 3, 6]),
        "fused.dpo": lambda: hk.fused.dpo(h @ W.T, y, lp, packed=[0, 3, 6]),
        "losses.dpo": lambda: hk.losses.dpo(lp, lp, y >= 0, packed=[0, 3, 6]),
    }
    for what, call in calls.items():
        with pytest.raises(ValueError, match="packed must be a humanline_kernels.Packed"):
            call()
            pytest.fail(what)


@pytest.mark.parametrize("packed, match", [
    (hk.Packed([0, 4, 9]), r"packed.cu_seqlens must start at 0, never decrease and end at the 7 packed positions"),
    (hk.Packed(torch.tensor([0, 4, 9])), r"packed.cu_seqlens must start at 0"),
    (hk.Packed(torch.tensor([3, 4, 7]), max_seqlen=4), r"packed.cu_seqlens must start at 0"),
    (hk.Packed([0, 4, 7], max_seqlen=3), r"packed.max_seqlen=3 is shorter than the longest packed sequence"),
    (hk.Packed([0]), r"packed.cu_seqlens must hold at least one sequence"),
], ids=["list", "tensor", "tensor_max_seqlen", "max_seqlen", "no_sequence"])
def test_fused_linear_token_logprobs_checks_packed_without_supervised(packed, match):
    """Without supervised ranges the packed boundaries were ignored (ending at 9 for a 7-position stream): checked as
    at the losses. A stream whose boundaries hold gives the log-probs of the call without them."""
    h, W, y, _ = _stream()
    with pytest.raises(ValueError, match=match):
        hk.fused_linear.token_logprobs(h, W, y, packed=packed)
    with pytest.raises(ValueError, match=r"hidden must have shape \[N, D\] or \[1, N, D\]"):
        hk.fused_linear.token_logprobs(h.view(1, 7, 4).expand(2, 7, 4), W, y.expand(2, 7),
                                       packed=hk.Packed([0, 4, 7]))
    want = hk.fused_linear.token_logprobs(h, W, y)
    for good in (hk.Packed([0, 4, 7]), hk.Packed(torch.tensor([0, 4, 7]), max_seqlen=4)):
        torch.testing.assert_close(hk.fused_linear.token_logprobs(h, W, y, packed=good), want)
        torch.testing.assert_close(hk.fused_linear.token_logprobs(h[None], W, y[None], packed=good), want[None])


@pytest.mark.parametrize("level", ["losses", "fused", "fused_linear"])
def test_kl_packed_errors_name_kl_packed(level):
    """KTO's KL rows packed: a bad kl_packed was reported as `packed` (the batch's own argument), a bad kl_logps as
    `logps`; kl_packed without KL rows was ignored."""
    h, W, y, lp = _stream(N=6)
    des = torch.tensor([True, False])
    m = y >= 0

    def call(*kl, kl_packed):
        if level == "losses":
            return hk.losses.kto(lp.view(2, 3), lp.view(2, 3), m.view(2, 3), des, *kl, kl_packed=kl_packed)
        x = (h.view(2, 3, 4) @ W.T,) if level == "fused" else (h.view(2, 3, 4), W)
        return getattr(hk, level).kto(*x, y.view(2, 3), lp.view(2, 3), des, *kl, kl_packed=kl_packed)

    kl = (lp, lp.clone(), m)
    with pytest.raises(ValueError, match="kl_packed must be a humanline_kernels.Packed"):
        call(*kl, kl_packed=[0, 3, 6])
    with pytest.raises(ValueError, match=r"kl_packed.cu_seqlens must start at 0, never decrease and end at the 6"):
        call(*kl, kl_packed=hk.Packed([0, 3, 9]))
    with pytest.raises(ValueError, match=r"kl_packed.max_seqlen=2 is shorter"):
        call(*kl, kl_packed=hk.Packed([0, 3, 6], max_seqlen=2))
    with pytest.raises(ValueError, match=r"kl_logps must have shape \[N\] or \[1, N\]"):
        call(lp.view(2, 3), lp.view(2, 3), m.view(2, 3), kl_packed=hk.Packed([0, 3, 6]))
    with pytest.raises(ValueError, match="kl_packed gives the boundaries of the KL rows"):
        call(kl_packed=hk.Packed([0, 3, 6]))
    call(*kl, kl_packed=hk.Packed([0, 3, 6]))  # (the same rows, well formed: accepted)


# --- bool keywords are bools -------------------------------------------------------------------------------------

def _flag_calls():
    x, y, r = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    h, W = torch.randn(2, 3, 4), torch.randn(5, 4)
    des, adv = torch.tensor([True, False]), torch.ones(2)
    return {
        "token_logprobs": (lambda **kw: hk.token_logprobs(x, y, **kw),
                           ("validate", "return_entropy", "inplace_backward")),
        "reference.token_logprobs": (lambda **kw: hk.reference.token_logprobs(x, y, **kw),
                                     ("validate", "return_entropy")),
        "fused.grpo": (lambda **kw: hk.fused.grpo(x, y, r, adv, **kw),
                       ("validate", "grad_in_forward", "inplace_backward")),
        "fused.dpo": (lambda **kw: hk.fused.dpo(x, y, r, **kw), ("validate", "inplace_backward")),
        "fused.kto": (lambda **kw: hk.fused.kto(x, y, r, des, **kw), ("validate", "inplace_backward")),
        "fused.sequence_logratios": (lambda **kw: hk.fused.sequence_logratios(x, y, r, **kw),
                                     ("validate", "inplace_backward", "normalize")),
        "fused.simpo": (lambda **kw: hk.fused.simpo(x, y, **kw), ("validate", "inplace_backward")),
        "fused_linear.token_logprobs": (lambda **kw: hk.fused_linear.token_logprobs(h, W, y, **kw),
                                        ("validate", "return_entropy")),
        "fused_linear.dpo": (lambda **kw: hk.fused_linear.dpo(h, W, y, r, **kw), ("validate",)),
        "fused_linear.grpo": (lambda **kw: hk.fused_linear.grpo(h, W, y, r, adv, **kw), ("validate",)),
        "fused_linear.kto": (lambda **kw: hk.fused_linear.kto(h, W, y, r, des, **kw), ("validate",)),
    }


@pytest.mark.parametrize("fn", list(_flag_calls()))
@pytest.mark.parametrize("path", ["kernels", "eager"])
def test_bool_keywords_refuse_what_bool_would_coerce(fn, path, monkeypatch):
    """validate=None skipped the checks, inplace_backward="no" wrote the gradient into the caller's logits,
    return_entropy="no" returned a tuple: a flag that is not a bool is refused by name, on either path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if path == "kernels" else "0")
    call, flags = _flag_calls()[fn]
    for flag in flags:
        for bad in ("no", None, 1):
            with pytest.raises(ValueError, match=f"{flag} must be a bool, got {bad!r}"):
                call(**{flag: bad})


@pytest.mark.parametrize("level", ["reference", "losses", "fused", "fused_linear"])
def test_a_bool_loss_weight_is_refused_at_every_level(level):
    """loss_weights=[True] with the one type "sigmoid" took plain DPO's shortcut ((True,) == (1.0,)) past the
    weight's check, at every level."""
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(2, 3, 4, generator=g), torch.randn(5, 4, generator=g)
    y, r = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    lp = hk.reference.token_logprobs(h @ W.T, y)
    args = {"reference": (lp, r, y >= 0), "losses": (lp, r, y >= 0), "fused": (h @ W.T, y, r),
            "fused_linear": (h, W, y, r)}[level]
    with pytest.raises(ValueError, match="loss_weights must be a finite real number, got True"):
        getattr(hk, level).dpo(*args, loss_weights=[True])
    getattr(hk, level).dpo(*args, loss_weights=[1.0])



def test_eager_and_kernel_paths_refuse_alike(monkeypatch):
    """The refusals above come before the choice of path: the same exception and message on the Triton kernels and
    on their eager twins (TRITON_INTERPRET=0 on CPU tensors)."""
    h, W, y, lp = _stream(N=6)
    des, m = torch.tensor([True, False]), (y >= 0).view(2, 3)
    calls = [
        lambda: hk.fused_linear.token_logprobs(h, W, y, supervised=[[0, 3], [0, 3]], packed=[0, 3, 6]),
        lambda: hk.fused_linear.token_logprobs(h, W, y, packed=hk.Packed([0, 4, 9])),
        lambda: hk.fused_linear.dpo(torch.randn(2, 3, 0), torch.randn(5, 0), y.view(2, 3), lp.view(2, 3)),
        lambda: hk.fused.kto(h.view(2, 3, 4) @ W.T, y.view(2, 3), lp.view(2, 3), des, lp, lp, y >= 0,
                             kl_packed=hk.Packed([0, 3, 9])),
        lambda: hk.fused_linear.kto(h.view(2, 3, 4), W, y.view(2, 3), lp.view(2, 3), des,
                                    kl_packed=hk.Packed([0, 3, 6])),
        lambda: hk.fused.dpo(h.view(2, 3, 4) @ W.T, y.view(2, 3), lp.view(2, 3), inplace_backward="no"),
        lambda: hk.fused.dpo(h.view(2, 3, 4) @ W.T, y.view(2, 3), lp.view(2, 3), loss_weights=[True]),
        lambda: hk.losses.dpo(lp.view(2, 3), lp.view(2, 3), m, clip=hk.HumanlineClip(-1e300, 1.0)),
    ]

    def errors(interp):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        out = []
        for call in calls:
            with pytest.raises(ValueError) as e:
                call()
            out.append(str(e.value))
        return out
    assert errors("1") == errors("0")

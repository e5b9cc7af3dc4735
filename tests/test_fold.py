"""The one-launch forward: the finalize folded into the row kernel (ops/fold.py) and GRPO's gradient in
the forward on a persistent grid, against hk.reference, and against the row kernel followed by a finalize launch
(the path of a packed batch and of the fused-linear chunks, forced here on dense batches by the test's own
``unfolded`` patch of ``fused._one_launch``). The interpreter runs a grid's programs in order, so here the last
program is always the last row: these tests pin the arithmetic (tiles, partial sums, tails, the shared weight), the
counters' protocol (zero before and after a launch, an interrupted launch cleaned up) and the bits' independence
from the path; the ordering between programs is the GPU test's at the end of this file."""
import pytest
import torch
from test_fused_losses import _data, _run

import humanline_kernels as hk
from humanline_kernels import _params as P
from humanline_kernels import fused
from humanline_kernels.ops import _jit, fold, grpo, kto
from humanline_kernels.ops import kernels as FK
from humanline_kernels.ops import token_terms as TK


def unfolded(monkeypatch):
    """Dense batches take the row kernel and a finalize launch after it (the path of packed batches)."""
    monkeypatch.setattr(fused, "_one_launch", lambda tokens, labels: False)


@pytest.fixture(params=["folded", "unfolded"])
def path(request, monkeypatch):
    if request.param == "unfolded":
        unfolded(monkeypatch)
    return request.param


def _counters_zero():
    return all(int(buf.abs().sum()) == 0 for buf in fold._COUNTERS.values())


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("gif", [False, True])
def test_grpo_every_loss_type(loss_type, gif, path):
    """T = 9 tokens a row cross three tiles of 4 (the last one short), V = 130 a whole block and a tail; the
    persistent grid (3 programs in the interpreter) walks 9 rows each."""
    x, y, ref = _data(3, 9, 130, seed=21)
    kw = dict(loss_type=loss_type, beta=0.05, grad_in_forward=gif)
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 12
    _run("grpo", x, y, ref, (torch.tensor([1.0, -0.5, 0.7]),), kw, upstream=1.0 if loss_type != "grpo" else 2.5)
    assert _counters_zero()


@pytest.mark.parametrize("opts", [dict(clip=None), dict(normalizer=6.5, loss_type="bnpo"),
                                  dict(normalizer=torch.tensor(3.0)), dict(temperature=0.7, epsilon_high=0.28)])
def test_grpo_options_with_gradient_in_forward(opts, path):
    """The shared row weight the persistent grid finds itself: a number or tensor normalizer, the token count; the
    clip off; a temperature (folded into the sweep's one FMA)."""
    x, y, ref = _data(4, 6, 77, seed=22)
    kl_ref = ref + 0.1 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    _run("grpo", x, y, ref, (torch.tensor([0.5, -1.0, 1.0, 2.0]),), dict(opts, beta=0.1, kl_ref_logps=kl_ref,
                                                                        grad_in_forward=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
def test_grpo_half_precision_in_place(dtype, inplace, path):
    x, y, ref = _data(2, 5, 200, dtype, seed=23)
    adv = torch.tensor([1.0, -1.0])
    _run("grpo", x, y, ref, (adv,), dict(grad_in_forward=True, inplace_backward=inplace), upstream=-3.0)
    _run("grpo", x, y, ref, (adv,), dict(inplace_backward=inplace, loss_type="grpo"))


@pytest.mark.parametrize("clip", [hk.HumanlineClip(), None])
def test_dpo(clip, path):
    x, y, ref = _data(4, 9, 150, seed=24)
    _run("dpo", x, y, ref, (), dict(clip=clip, beta=0.2, label_smoothing=0.1, temperature=1.5))


@pytest.mark.parametrize("kl", ["rows", "none", "trl baseline"])
def test_kto(kl, path):
    """KTO's baseline: program 0 walks the KL rows before its own row; without rows it is 0; TRL's estimate comes
    in computed (``z0`` given)."""
    x, y, ref = _data(5, 7, 90, seed=25)
    g = torch.Generator().manual_seed(4)
    des = torch.tensor([True, False, True, True, False])
    rows = ()
    if kl != "none":
        kl_m = torch.rand(6, 9, generator=g) > 0.3
        kl_m[1] = False
        rows = (torch.randn(6, 9, generator=g) * 0.6 + 0.5, torch.zeros(6, 9), kl_m)
    kw = dict(beta=0.3, clip=hk.HumanlineClip(-1.0, 1.0), desirable_weight=1.3)
    if kl == "trl baseline":
        kw["kl_estimate"] = "trl"
    _run("kto", x, y, ref, (des, *rows), kw)


@pytest.mark.parametrize("shape", [(1, 21, 50), (6, 1, 64), (1, 1, 5), (2, 4, 128), (2, 3, 256)])
def test_shapes(shape, path):
    """One long row (6 tiles), one token a row, a single token, V a whole number of blocks (no tail), V below a
    block; the last of several rows fully ignored (``_data``'s)."""
    B, T, V = shape
    x, y, ref = _data(B, T, V, seed=sum(shape))
    if B == 1:  # _data ignores its last row: here a row with labels
        x, y, ref = (t[:1] for t in _data(2, T, V, seed=sum(shape)))
    adv = torch.linspace(-1.0, 1.0, B)
    for gif in (False, True):
        _run("grpo", x, y, ref, (adv,), dict(grad_in_forward=gif, beta=0.04, loss_type="grpo"))
    if B % 2 == 0:
        _run("dpo", x, y, ref, (), {})
    _run("kto", x, y, ref, (torch.arange(B) % 2 == 0, ref, ref - 0.3, y != -100), {})


@pytest.mark.parametrize("kind", ["grpo", "grpo gif", "dpo", "kto"])
def test_same_bits_as_the_unfolded_path(kind, monkeypatch):
    """The fold sums per tile and then the tiles, the finalize launch per ``[BLOCK_B, BLOCK_T]`` tile: different
    orders of the same fp32 sums, so the losses agree to rounding (here, at these sizes, to the bit); every
    per-token output and the logits' gradient are the same bits; twice the same call gives the same bits."""
    x, y, ref = _data(4, 13, 90, seed=26)
    extra = {"grpo": (torch.tensor([1.0, -0.5, 0.7, 2.0]),), "dpo": (),
             "kto": (torch.tensor([True, False, True, False]), ref, ref - 0.2, y != -100)}[kind.split()[0]]
    kw = dict(grad_in_forward=True, beta=0.04) if kind == "grpo gif" else {}
    out = {}
    for name in ("folded", "folded again", "previous"):
        if name == "previous":
            unfolded(monkeypatch)
        leaf = x.detach().clone().requires_grad_()
        loss, met = getattr(hk.fused, kind.split()[0])(leaf[:, :-1], y, ref, *extra, **kw)
        loss.backward()
        out[name] = (loss.detach(), torch.stack(list(met.values())), leaf.grad)
    for a, b in zip(out["folded"], out["folded again"]):
        assert torch.equal(a, b)
    for a, b in zip(out["folded"], out["previous"]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.equal(out["folded"][2], out["previous"][2])


def test_counters_zero_after_an_interrupted_launch(monkeypatch):
    """The counters must be zero before every launch (no fill is launched): a launch that stops half way (an
    interpreted one can; a compiled one cannot without losing the CUDA context) leaves some non-zero, and the
    launcher zeroes them before the error goes on."""
    x, y, ref = _data(3, 6, 40, seed=27)
    adv = torch.ones(3)
    hk.fused.grpo(x[:, :-1], y, ref, adv)  # the buffer exists
    assert fold._COUNTERS and _counters_zero()
    original = grpo.launcher

    def half(kernel, t):
        twin = original(kernel, t)

        class Grid:
            def __getitem__(self, grid):
                def run(**kwargs):
                    twin[(grid[0] // 2,)](**kwargs)  # the first half of the rows count themselves in
                    raise KeyboardInterrupt
                return run
        return Grid()
    monkeypatch.setattr(grpo, "launcher", half)
    with pytest.raises(KeyboardInterrupt):
        hk.fused.grpo(x[:, :-1], y, ref, adv)
    assert _counters_zero()
    monkeypatch.setattr(grpo, "launcher", original)
    _run("grpo", x, y, ref, (adv,), {})


def test_one_launch_a_direction(monkeypatch):
    """DPO, KTO and GRPO (default loss type, also with the gradient in the forward) of a dense batch: one Triton
    launch forward, one backward; GRPO's "grpo" loss type with the gradient in the forward also launches the
    weights-only finalize."""
    x, y, ref = _data(4, 5, 60, seed=28)
    calls = {
        "grpo": (lambda v: hk.fused.grpo(v, y, ref, torch.ones(4)), ["_grpo_loss_kernel", "_logprobs_bwd_kernel"]),
        "grpo gif": (lambda v: hk.fused.grpo(v, y, ref, torch.ones(4), grad_in_forward=True),
                     ["_grpo_loss_kernel", "_scale_rows_kernel"]),
        "grpo gif grpo": (lambda v: hk.fused.grpo(v, y, ref, torch.ones(4), grad_in_forward=True, loss_type="grpo"),
                          ["_grpo_finalize_kernel", "_grpo_loss_kernel", "_scale_rows_kernel"]),
        "dpo": (lambda v: hk.fused.dpo(v, y, ref), ["_dpo_loss_kernel", "_logprobs_bwd_kernel"]),
        "kto": (lambda v: hk.fused.kto(v, y, ref, torch.ones(4, dtype=torch.bool)),
                ["_kto_loss_kernel", "_logprobs_bwd_kernel"]),
    }
    for name, (fn, kernels) in calls.items():
        leaf = x.detach().clone().requires_grad_()
        _jit.LAUNCHES.clear()
        fn(leaf[:, :-1] * 1)[0].backward()
        assert sorted(k for _, k in _jit.LAUNCHES.elements()) == sorted(kernels), (name, _jit.LAUNCHES)


def test_persistent_grid_walks_the_rows(monkeypatch):
    """The persistent grid is ``min(rows, SMs x GIF_PROGRAMS_PER_SM)`` programs (3 "SMs" in the interpreter): 6
    programs for 10 rows, as many as rows when they are fewer; 3 programs walk ten rows, 3 or 4 each."""
    seen = []
    original = grpo.launcher

    def record(kernel, t):
        twin = original(kernel, t)

        class Grid:
            def __getitem__(self, grid):
                def run(**kwargs):
                    if kernel.fn.__name__ == "_grpo_loss_kernel":
                        seen.append((grid, kwargs["GRAD"]))
                    return twin[grid](**kwargs)
                return run
        return Grid()
    monkeypatch.setattr(grpo, "launcher", record)
    monkeypatch.setattr(grpo, "GIF_PROGRAMS_PER_SM", 2)
    x, y, ref = _data(2, 5, 60, seed=29)
    _run("grpo", x, y, ref, (torch.tensor([1.0, -1.0]),), dict(grad_in_forward=True))
    _run("grpo", x[:1, :2], y[:1, :1], ref[:1, :1], (torch.tensor([1.0]),), dict(grad_in_forward=True))
    monkeypatch.setattr(grpo, "GIF_PROGRAMS_PER_SM", 1)
    _run("grpo", x, y, ref, (torch.tensor([1.0, -1.0]),), dict(grad_in_forward=True))
    assert seen == [((6,), 3), ((1,), 3), ((3,), 3)]  # 3: the persistent grid, the shared row weight


def test_opcheck():
    """The folded launchers' torch.library ops: schema, fake tensors, autograd registration, AOT dispatch."""
    x, y, ref = _data(2, 3, 40, seed=30)
    x3 = x[:, :-1]
    f32 = dict(dtype=torch.float32)

    def outs(planes, k):
        return (torch.empty(2, 3), torch.empty(2, 3), torch.empty(2, 3), torch.empty(planes, 2, 3), torch.empty(()),
                torch.empty(k), torch.empty(2))
    hl = torch.ops.humanline
    w = torch.tensor([0.2, 0.3])
    grpo = (True, -1.5, 1.5, 0.8, 1.2, 0.1, 1.0, -100, 0, 0.0, 0)
    cases = [
        (hl.dpo_loss_out, (x3, y, ref, *outs(4, 5), True, -1.5, 1.5, 1.0, -100, 0.1, 0.0)),
        (hl.kto_loss_out, (x3, y, ref, torch.tensor([True, False]), ref, ref - 1, y != -100, None, *outs(4, 4), True,
                           -1.5, 1.5, 1.0, -100, 0.1, 1.0, 1.0)),
        (hl.kto_loss_out, (x3, y, ref, torch.tensor([True, False]), None, None, None, torch.tensor([0.3], **f32),
                           *outs(4, 4), False, 0.0, 0.0, 1.0, -100, 0.1, 1.0, 1.0)),
        (hl.grpo_loss_out, (x3, y, ref, None, torch.ones(2), None, None, False, None, *outs(5, 4), *grpo)),
        (hl.grpo_loss_out, (x3, y, ref, ref, torch.ones(2), w, torch.empty_like(x3), False, torch.tensor([2.0]),
                            *outs(5, 4), *grpo[:-3], 1, 0.0, 0)),
        (hl.grpo_loss_out, (x3, y, ref, None, torch.ones(2), None, torch.empty_like(x3), False, None, *outs(5, 4),
                            *grpo)),
        (hl.grpo_loss_inplace, (x.clone()[:, :-1], y, ref, None, torch.ones(2), None, None, True, None, *outs(5, 4),
                                *grpo)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_kto_given_z0_launcher_matches_the_finalize():
    """The launcher with a given baseline (the distributed path's all-reduced ``z0``) against the row kernel and the
    finalize kernel on the same inputs."""
    x, y, ref = _data(4, 5, 60, seed=31)
    p = P.KTO(clip=hk.HumanlineClip(), beta=0.2, undesirable_weight=1.5)
    inp = P.KTOInputs(torch.tensor([True, False, False, True]), z0=torch.tensor(0.37))
    got = kto.kto_loss(x[:, :-1], y, ref, p, inp)
    val, coef, lse, aux = TK.token_terms(x[:, :-1], y, ref, p, inp)
    want = (val, coef, lse, aux, *FK.kto_finalize(val, aux, y, p, inp))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------ on a GPU: the ordering between programs
_STRESS = {  # name -> (B, T, V): tiny rows finish together (the counters' worst contention), long ones out of order
    "8192 tokens, V = 64": (64, 128, 64),
    "one long row, V = 4096": (1, 8192, 4096),
    "4096 tokens, V = 32000": (8, 512, 32000),
}


def _stress_calls(B, T, V, device="cuda"):
    """name -> (logits, the fused call on them, the same loss in float64 through ``hk.reference``)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(B, T, V, device=device, generator=g).to(torch.bfloat16)
    y = torch.randint(0, V, (B, T), device=device, generator=g)
    y[torch.rand(B, T, device=device, generator=g) < 0.2] = -100
    ref = torch.randn(B, T, device=device, generator=g) - 4
    adv = torch.randn(B, device=device, generator=g)
    rows = (B // 2) * 2 or 2
    des = torch.arange(B, device=device) % 2 == 0
    R = hk.reference
    lp = R.token_logprobs
    d = torch.float64
    yd = y[:rows] if B > 1 else y.view(2, -1)
    refd = ref[:rows] if B > 1 else ref.view(2, -1)
    return {
        "grpo": (x, lambda v: hk.fused.grpo(v, y, ref, adv, beta=0.04, validate=False),
                 lambda v: R.grpo(lp(v, y), ref.to(d), adv.to(d), y != -100, beta=0.04)),
        "grpo dapo gif": (x, lambda v: hk.fused.grpo(v, y, ref, adv, grad_in_forward=True, validate=False),
                          lambda v: R.grpo(lp(v, y), ref.to(d), adv.to(d), y != -100)),
        "grpo grpo gif": (x, lambda v: hk.fused.grpo(v, y, ref, adv, loss_type="grpo", grad_in_forward=True,
                                                     validate=False),
                          lambda v: R.grpo(lp(v, y), ref.to(d), adv.to(d), y != -100, loss_type="grpo")),
        "dpo": (x[:rows] if B > 1 else x.view(2, T // 2, V),
                lambda v: hk.fused.dpo(v, yd, refd, validate=False),
                lambda v: R.dpo(lp(v, yd), refd.to(d), yd != -100)),
        "kto": (x, lambda v: hk.fused.kto(v, y, ref, des, ref, ref - 0.3, y != -100, validate=False),
                lambda v: R.kto(lp(v, y), ref.to(d), y != -100, des, ref.to(d), (ref - 0.3).to(d), y != -100)),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(_STRESS))
def test_gpu_fold_is_deterministic_and_matches_the_unfolded_path(shape, monkeypatch, compiled_kernels):
    """What the interpreter cannot show: with programs finishing in any order, every counter's last arrival sees
    every earlier program's stores. Twenty folded calls give the same bits and the counters are zero after each.
    The two paths sum the same fp32 terms in different orders, and with thousands of tokens a row (the DPO pair of
    4096-token rows) a loss that is a small difference of large sums differs by more than a fixed 1e-5: so each path
    is measured against the loss in float64 (``hk.reference`` on the upcast logits), and the fold's error must be at
    most twice the unfolded path's (plus 1e-6 relative) for the loss, every metric and the gradient."""
    for name, (x, fn, truth) in _stress_calls(*_STRESS[shape]).items():
        runs = []
        for folded in [True] * 20 + [False]:
            if not folded:
                unfolded(monkeypatch)
            leaf = x.detach().clone().requires_grad_()
            loss, met = fn(leaf)
            loss.backward()
            torch.cuda.synchronize()
            assert _counters_zero(), name
            runs.append((loss.detach(), torch.stack(list(met.values())), leaf.grad))
        for run in runs[1:-1]:
            for a, b in zip(runs[0], run):
                assert torch.equal(a, b), name
        _against_float64(shape, name, runs[0], runs[-1], x, truth, list(met))


def _against_float64(shape, name, fold, previous, x, truth, keys):
    leaf = x.detach().double().requires_grad_()
    loss, met = truth(leaf)
    loss.backward()
    want = (loss.detach(), torch.stack([met[k] for k in keys]).detach(), leaf.grad)
    for what, a, b, t in zip(("loss", "metrics", "gradient"), fold, previous, want):
        scale = t.norm().clamp_min(1e-30)
        err_fold, err_prev = ((v.double() - t).norm() / scale for v in (a, b))
        print(f"{shape} {name} {what}: fold {float(err_fold):.3g}, previous {float(err_prev):.3g} "
              "(relative to float64)")
        assert err_fold <= 2 * err_prev + 1e-6, (name, what, float(err_fold), float(err_prev))


def test_row_kernels_register_budget(monkeypatch):
    """A folded row kernel's ``maxnreg`` leaves room for ``ROW_WARPS_PER_SM`` warps an SM: 72 registers at 4 warps
    (7 programs), 80 at 8 (3 programs), half the programs for fp32 rows; 4 warps an SM would give one program's
    share (248)."""
    from humanline_kernels.ops import _jit
    x = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16)  # meta as a compiled device, as the gate routes it
    _jit.COMPILED_DEVICES.add("meta")  # (the one set every launcher module imported)
    try:
        assert fold.row_register_budget(x, 4) == {"maxnreg": 72}
        assert fold.row_register_budget(x, 8) == {"maxnreg": 80}
        assert fold.row_register_budget(x.float(), 4) == {"maxnreg": 168}  # fp32 rows: 3 programs
        monkeypatch.setattr(fold, "ROW_WARPS_PER_SM", 4)
        assert fold.row_register_budget(x, 4) == {"maxnreg": 248}
    finally:
        _jit.COMPILED_DEVICES.discard("meta")

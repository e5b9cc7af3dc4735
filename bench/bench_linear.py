"""``python -m bench linear [--quick]``: fused linear path (hidden + lm_head weight -> loss), forward + backward.

Default shape: N = 8192 tokens (B=8 rows x T=1024), D = 4096, V = 128256, bf16, on CUDA. Every row is timed in the
same run as the bare lm_head GEMM forward+backward (3 GEMMs: z = hW^T, dh = dz W, dW = dz^T h), and reports
``ratio`` = time / that floor and the peak memory beyond the inputs. Peers are run when importable: eager (logits
materialised), a torch.compile'd chunked version (checkpointed per chunk), torch's own chunked
``F.linear_cross_entropy(reduction="none")`` (torch >= 2.13), TRL's ``ChunkedLogProbFunction``, Liger
``LigerFusedLinear{GRPO,DPO,KTO}Loss`` (``use_ref_model=False``: no reference GEMM), quack ``linear_cross_entropy``
and Apple ``cut_cross_entropy`` (plain cross-entropy; shown for the GEMM-floor comparison). ``--quick`` is a tiny
CPU smoke run of the same code.

``--ignored 0 50 75``: prompt-like masks (the first 0 / 50 / 75 % of every row ignored); ours dense and on the
supervised tokens only (``supervised=`` ranges), and every peer on the same masks, against the dense GEMM floor;
writes ``linear_masks.json`` / ``.png`` (ratio against the ignored share). Target (docs/design.md, issue 33): at
50 % ignored, ``hk.fused_linear.dpo`` with ``supervised`` at most 0.55x the dense floor.

``--live-bytes``: no timing and no GPU; the peak memory of ours per loss and of the floor at the given shape,
counted on the CPU (bench/live_bytes.py), against the target (at most the floor's + 0.25 GiB).
"""
from __future__ import annotations

import os

import torch

from . import common
from .cli import Parser

GiB = float(1 << 30)


def _inputs(B, T, D, V, dtype, device, seed=0, prompt=None):
    """``prompt``: ignored positions at the start of each row (default ``T // 8``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(B, T, D, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(V, D, device=device, dtype=dtype, generator=g) * D ** -0.5).requires_grad_()
    y = torch.randint(0, V, (B, T), device=device, generator=g)
    y[:, :T // 8 if prompt is None else prompt] = -100  # prompt tokens
    import humanline_kernels as hk
    ref = hk.fused_linear.token_logprobs_nograd(h, w, y) + 0.1 * torch.randn(B, T, device=device, generator=g)
    adv = torch.randn(B, device=device, generator=g)
    return h, w, y, ref, adv


def _cases(h, w, y, ref, adv, chunk_bytes, quick, supervised=None):
    """name -> fn() running forward + backward (grads reset first). ``supervised``: also our losses on the
    supervised positions only (``hk.fused_linear``'s ``supervised=`` ranges)."""
    import humanline_kernels as hk
    B, T, D = h.shape
    V = w.shape[0]
    mask = y != -100
    des = torch.arange(B, device=h.device) % 2 == 0
    h2, y2 = h.view(-1, D), y.view(-1)
    cases = {}

    def fb(loss_fn):
        def run():
            h.grad = w.grad = None
            loss_fn().backward()
        return run

    gz = torch.empty(B * T, V, device=h.device, dtype=h.dtype)  # lm_head floor: 3 GEMMs, bf16 out

    def gemm():
        hd = h2.detach()
        torch.mm(hd, w.detach().t(), out=gz)
        torch.mm(gz, w.detach())
        torch.mm(gz.t(), hd)
    cases["lm_head_gemm_fwd_bwd"] = gemm
    for cb in chunk_bytes:
        tag = f"@{cb >> 20}MiB" if cb >= 1 << 20 else f"@{cb >> 10}KiB"
        cases["ours_grpo" + tag] = fb(lambda cb=cb: hk.fused_linear.grpo(h, w, y, ref, adv, chunk_bytes=cb,
                                                                        validate=False)[0])
    cb = chunk_bytes[0]
    cases["ours_dpo"] = fb(lambda: hk.fused_linear.dpo(h, w, y, ref, chunk_bytes=cb, validate=False)[0])
    cases["ours_kto"] = fb(lambda: hk.fused_linear.kto(h, w, y, ref, des, chunk_bytes=cb, validate=False)[0])
    cases["ours_token_logprobs(recompute)"] = fb(
        lambda: hk.fused_linear.token_logprobs(h, w, y, chunk_bytes=cb, validate=False).sum())
    if supervised is not None:
        sv = dict(chunk_bytes=cb, validate=False, supervised=supervised)
        cases["ours_grpo(supervised)"] = fb(lambda: hk.fused_linear.grpo(h, w, y, ref, adv, **sv)[0])
        cases["ours_dpo(supervised)"] = fb(lambda: hk.fused_linear.dpo(h, w, y, ref, **sv)[0])
        cases["ours_kto(supervised)"] = fb(lambda: hk.fused_linear.kto(h, w, y, ref, des, **sv)[0])

    def grpo_from(lp):
        return hk.losses.grpo(lp.view(B, T), ref, adv, mask)[0]

    def eager():
        return grpo_from(hk.reference.token_logprobs(h @ w.t(), y, validate=False))
    cases["eager_grpo"] = fb(eager)

    if not quick:
        rows = max(1, cb // (V * h.element_size()))

        @torch.compile(dynamic=False)
        def chunk_lp(hc, wt, yc):
            z = (hc @ wt.t()).float()
            return torch.log_softmax(z, -1).gather(-1, yc.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (yc != -100)

        def compiled():
            from torch.utils.checkpoint import checkpoint
            lp = torch.cat([checkpoint(chunk_lp, h2[s:s + rows], w, y2[s:s + rows], use_reentrant=False)
                            for s in range(0, B * T, rows)])
            return grpo_from(lp)
        cases["torch_compile_chunked_grpo"] = fb(compiled)

    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # public in TRL 1.16
        # forward(hidden [N, H], weight, bias, targets, temperature, chunk_size): TRL 1.16 signature
        cases["trl_chunked_logprob_grpo"] = fb(lambda: grpo_from(
            ChunkedLogProbFunction.apply(h2, w, None, y2.clamp(min=0), 1.0, 4096)[0] * mask.view(-1)))
    except Exception as e:  # noqa: BLE001
        cases["trl_chunked_logprob_grpo"] = f"unavailable: {type(e).__name__}: {e}"[:120]

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss, LigerFusedLinearGRPOLoss, LigerFusedLinearKTOLoss
        lg = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo")
        ld = LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=False)
        lk = LigerFusedLinearKTOLoss(beta=0.1, use_ref_model=False)
        cases["liger_grpo"] = fb(lambda: lg(h, w, y.clamp(min=0), mask.long(), adv, ref_per_token_logps=ref)[0])
        cases["liger_dpo"] = fb(lambda: ld(w, h, y)[0])
        cases["liger_kto"] = fb(lambda: lk(h, w, y, preference_labels=des,
                                           kl=torch.zeros((), device=h.device))[0])
    except Exception as e:  # noqa: BLE001
        cases["liger"] = f"unavailable: {type(e).__name__}: {e}"[:120]

    lce = getattr(torch.nn.functional, "linear_cross_entropy", None)  # torch >= 2.13: the native peer
    if lce is not None and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        opts = torch.nn.LinearCrossEntropyOptions()  # the chunked path (options=None materialises the logits)
        cases["torch_linear_cross_entropy_grpo(chunked)"] = fb(lambda: grpo_from(
            -lce(h2, w, y2, reduction="none", ignore_index=-100, options=opts)))
    else:
        cases["torch_linear_cross_entropy_grpo(chunked)"] = f"unavailable: torch {torch.__version__} has none"

    try:
        from quack.linear_cross_entropy import linear_cross_entropy as quack_lce
        cases["quack_linear_cross_entropy(mean)"] = fb(lambda: quack_lce(h2, w, None, y2, ignore_index=-100))
    except Exception as e:  # noqa: BLE001
        cases["quack_linear_cross_entropy(mean)"] = f"unavailable: {type(e).__name__}: {e}"[:120]

    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        cases["apple_cce_grpo"] = fb(lambda: grpo_from(-cce(h2, w, y2, reduction="none")))
    except Exception as e:  # noqa: BLE001
        cases["apple_cce_grpo"] = f"unavailable: {type(e).__name__}: {e}"[:120]
    return cases


def main(argv=None):
    p = Parser(prog="python -m bench linear", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output directory (default bench/out)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--D", type=int, default=4096)
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--chunk-mib", type=int, nargs="+", default=[512, 256, 1024],
                   help="logits-buffer budgets for ours (the first one is used for DPO/KTO/log-probs)")
    p.add_argument("--ignored", type=int, nargs="+", default=None, metavar="PCT",
                   help="prompt-like masks: the first PCT %% of each row ignored (e.g. 0 50 75); ours dense and on the "
                        "supervised tokens only, and the peers, against the dense GEMM floor (writes linear_masks.*)")
    p.add_argument("--profile", nargs="+", default=None, metavar="IMPL",
                   help="instead of timing: each named row (e.g. ours_dpo lm_head_gemm_fwd_bwd) under the torch "
                        "profiler, its device kernels per call by time (writes linear_profile.json)")
    p.add_argument("--live-bytes", action="store_true",
                   help="instead of timing: peak live bytes of one forward + backward (ours per loss, the floor) "
                        "counted on the CPU with meta tensors and stubbed launches, against the memory target "
                        "(bench/live_bytes.py; writes linear_live_bytes.json)")
    a = p.parse_args(argv)
    if a.live_bytes:
        from . import live_bytes
        return live_bytes.run(a.out, a.rows, a.T, a.D, a.V, a.chunk_mib[0] << 20)
    if a.ignored is not None and any(not 0 <= x < 100 for x in a.ignored):
        p.error(f"--ignored takes percentages in [0, 100), got {a.ignored}")
    device = "cuda" if torch.cuda.is_available() and not a.quick else "cpu"
    if a.quick:
        B, T, D, V, dtype, chunks = 4, 32, 64, 1000, torch.float32, [1 << 18]
    else:
        B, T, D, V, dtype, chunks = a.rows, a.T, a.D, a.V, torch.bfloat16, [m << 20 for m in a.chunk_mib]
    if a.ignored is not None:
        return _run_masks(B, T, D, V, dtype, device, chunks[:1], a.ignored, a.quick, a.out)
    h, w, y, ref, adv = _inputs(B, T, D, V, dtype, device)
    if a.profile is not None:
        cases = _cases(h, w, y, ref, adv, chunks, True)  # quick=True: no torch.compile peer to build
        unknown = [n for n in a.profile if not callable(cases.get(n))]
        if unknown:
            known = ", ".join(n for n, f in cases.items() if callable(f))
            p.error(f"--profile: no runnable row {unknown}; rows: {known}")
        rows = [r for n in a.profile for r in _profile(n, cases[n], device)]
        common.save("linear_profile_quick" if a.quick else "linear_profile", rows,
                    _shape(B, T, D, V, dtype, device, chunks), a.out, y="ms_per_call")
        return 0
    rows = _time_cases(_cases(h, w, y, ref, adv, chunks, a.quick), h, w, a.quick)
    meta = {**_shape(B, T, D, V, dtype, device, chunks), "timing": _timing(a.quick),
            "flops_floor": 6 * B * T * D * V,
            "dW_bytes(param dtype)": V * D * w.element_size(),
            "note": "peak_extra_GiB: peak allocated during fwd+bwd beyond what existed before, including the "
                    "returned grads (h.grad, w.grad); ours accumulates dW in the weight's dtype (no fp32 [V, D])"}
    common.save("linear_quick" if a.quick else "linear", rows, meta, a.out)
    _plot(rows, os.path.join(a.out, ("linear_quick" if a.quick else "linear") + ".png"), meta)
    return 0


def _profile(name, fn, device, reps=3):
    """One row's device kernels per call, by time: why a row costs what it does (run 3's fused-linear DPO went
    41.9 -> 45.5 ms with no change to its GEMMs)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kernels = {}
    for ev in prof.events():
        on_device = ev.device_type == torch.autograd.DeviceType.CUDA if cuda else ev.cpu_parent is None
        if not on_device:
            continue
        k = kernels.setdefault(ev.name[:120], [0, 0.0])
        k[0] += 1
        k[1] += (ev.device_time if cuda else ev.cpu_time_total) / 1e3
    table = sorted(({"impl": name, "kernel": n, "per_call": c / reps, "ms_per_call": t / reps}
                    for n, (c, t) in kernels.items()), key=lambda r: -r["ms_per_call"])
    total = sum(r["ms_per_call"] for r in table)
    what = "device kernels" if cuda else "top-level CPU ops"
    return [{"impl": name, "kernel": f"(all {what})", "per_call": sum(r["per_call"] for r in table),
             "ms_per_call": total}] + table


def _shape(B, T, D, V, dtype, device, chunks):
    """The run's shape, as every JSON of this suite records it."""
    return {"N": B * T, "B": B, "T": T, "D": D, "V": V, "dtype": str(dtype), "device": device, "chunk_bytes": chunks}


def _timing(quick):
    """How ``_time_cases`` times its rows, as a timed run's JSON records it."""
    rounds, calls = (2, 1) if quick else TIMING
    return {"rounds": rounds, "calls_a_round": calls, "how": "common.interleaved (CUDA events)"}


def _time_cases(cases, h, w, quick, progress=""):
    """Rows ``{impl, ms, ratio_to_gemm, spread_pct, peak_extra_GiB, note}``. Each case runs once (a peer that fails
    gets its note) and once more for its peak memory, one after another; then every runnable case, the GEMM floor
    among them, is timed in interleaved rounds (``common.interleaved``: CUDA events around each call). Not
    ``do_bench(rep=20)`` as before run 12: its ``rep`` is milliseconds, so at ~37 ms a call every row was one timed
    call, and run 11 measured the same floor 36.6 and 38.3 ms in two stages of one call."""
    rows, fns = [], {}
    for i, (name, fn) in enumerate(cases.items()):
        print(f"[linear{progress} {i + 1}/{len(cases)}] {name}", flush=True)
        row = {"impl": name, "ms": None, "ratio_to_gemm": None, "spread_pct": None, "peak_extra_GiB": None,
               "note": fn if isinstance(fn, str) else ""}
        rows.append(row)
        if isinstance(fn, str):
            continue
        try:
            fn()
            peak = common.peak_extra_bytes(fn)
            row["peak_extra_GiB"] = None if peak is None else peak / GiB
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 - a peer failing must not stop the table
            row["note"] = f"failed: {type(e).__name__}: {e}"[:160]
        h.grad = w.grad = None
    how = _timing(quick)
    print(f"[linear{progress}] timing {len(fns)} rows in {how['rounds']} interleaved rounds of "
          f"{how['calls_a_round']} calls", flush=True)
    ms, by_round = common.interleaved(fns, h.device.type, rounds=how["rounds"], calls=how["calls_a_round"])
    h.grad = w.grad = None
    floor_ms = ms.get("lm_head_gemm_fwd_bwd")
    for row in rows:
        t = ms.get(row["impl"])
        if t is not None:
            r = by_round[row["impl"]]
            row.update(ms=t, ratio_to_gemm=t / floor_ms if floor_ms else None,
                       spread_pct=100 * (max(r) - min(r)) / t)
    return rows


# (rounds, calls a round) on a GPU: each row 15 timed calls, ~0.6 s at the floor's ~37 ms, ~7 s for Liger's GRPO
TIMING = (5, 3)


# the peers and our dense rows compute every position; the design's target is on ours with the supervised tokens
MASK_TARGET = {"impl": "ours_dpo(supervised)", "ignored_pct": 50, "ratio_to_gemm": 0.55}


def _run_masks(B, T, D, V, dtype, device, chunks, ignored, quick, out):
    """Each prompt-like mask: the same cases (ours dense, ours on the supervised tokens, the peers) against the
    dense GEMM floor (all ``B T`` positions) measured in the same run."""
    rows = []
    for k, pct in enumerate(ignored):
        start = T * pct // 100
        h, w, y, ref, adv = _inputs(B, T, D, V, dtype, device, prompt=start)
        sup = [[start, T]] * B
        cases = _cases(h, w, y, ref, adv, chunks, quick, supervised=sup)
        for r in _time_cases(cases, h, w, quick, progress=f" {pct}% ignored ({k + 1}/{len(ignored)})"):
            rows.append({"ignored_pct": pct, **r})
        del h, w, y, ref, adv, cases
    t = MASK_TARGET
    hit = [r for r in rows if r["impl"] == t["impl"] and r["ignored_pct"] == t["ignored_pct"]]
    meta = {**_shape(B, T, D, V, dtype, device, chunks), "timing": _timing(quick), "ignored_pct": ignored,
            "flops_floor_dense": 6 * B * T * D * V,
            "target": t, "target_met": (hit[0]["ratio_to_gemm"] <= t["ratio_to_gemm"])
            if hit and hit[0]["ratio_to_gemm"] else None,
            "note": "ratio_to_gemm: time / the dense lm_head GEMM fwd+bwd over all B*T positions (the same floor at "
                    "every mask); the peers and ours dense compute every position"}
    name = "linear_masks_quick" if quick else "linear_masks"
    common.save(name, rows, meta, out, x="ignored_pct", y="ratio_to_gemm")
    return 0


def _plot(rows, path, meta):
    plt = common.pyplot()
    if plt is None:
        print("no plot: matplotlib is not installed (pip install matplotlib, or the .[bench] extra)")
        return
    pts = [(r["impl"], r["ratio_to_gemm"]) for r in rows if r.get("ratio_to_gemm")]
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(pts) + 1.2))
    ax.barh([n for n, _ in pts][::-1], [v for _, v in pts][::-1])
    ax.set_xscale("log")
    ax.axvline(1.05, color="r", ls="--", lw=1, label="target 1.05x (docs/design.md)")
    ax.set_xlabel("fwd+bwd time / bare lm_head GEMM fwd+bwd")
    ax.set_title(f"fused linear, N={meta['N']} D={meta['D']} V={meta['V']} ({common.env_info()['device']})",
                 fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    plt.close(fig)

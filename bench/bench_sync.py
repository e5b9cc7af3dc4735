"""Reference-sync benchmark: copy bandwidth, overlapped step overhead, a small FSDP2 step, vs the state_dict way.

``python -m bench sync [--quick] [--out DIR] [--gemms N]``

1. ``copy``: 1.23 B parameters in 290 tensors (a 24-layer, 2048-wide Qwen2.5-like layout with biases and a
   128256-row embedding), for (source, target) dtypes bf16->bf16, fp32->bf16 and fp32->fp32: our csrc/ kernel,
   ``torch._foreach_copy_`` (grouped), a per-tensor ``copy_`` loop and ``ReferenceSyncer.sync()`` end to end.
   ``ratio_to_copy_bw`` = achieved (read + write) bandwidth / a plain 1 GiB ``copy_`` measured in the same run.
2. ``overlap``: a GEMM workload (``--gemms`` bf16 8192^3 matmuls, about a 1.2 B-model step) alone, with an
   overlapped sync (fp32 policy -> bf16 reference) started before and waited after it, and with a blocking sync;
   then a bf16 policy (same-dtype groups) overlapped, copied by our kernel and by the copy engines
   (``ReferenceSyncer(copy_engine=True)``, the default: the extension's one ``cudaMemcpyBatchAsync`` hinted to
   overlap with compute, and ``copy_`` per tensor; a copy engine takes no SMs from the GEMMs); then the same
   GEMMs as a policy's forward (one leaf module each) with the sync paced in ``--slices`` parts
   (``ReferenceSyncer(slices=...)``).
3. ``fsdp2``: a training step of a small FSDP2 model (world size 1) with and without the overlapped sync, and
   with the paper's way (``unwrap_model(policy).state_dict()`` + ``reference.load_state_dict``, here the full
   state dict through ``torch.distributed.checkpoint.state_dict``); ``ratio`` = state_dict way / our sync.
``--quick``: tiny shapes on CPU (a smoke test of the harness; the numbers mean nothing).

Timings are medians of ``triton.testing.do_bench``, whose ``rep``/``warmup`` are milliseconds, not counts. The
overlap rows (about 100 ms a call, differences of ~1 %) are timed interleaved: six rounds, each running every row
five times in turn (CUDA events around each call), so that the card's drift over the table falls on every row
alike; ``spread_pct`` is a row's range of per-round medians over its median.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from . import common
from .cli import Parser


def time_reps(fn, reps=20, warmup=3) -> float:
    """Median ms of ``fn()`` over about ``reps`` calls (``do_bench`` counts ``rep`` in ms: a 90 ms step with
    ``rep=30`` would be timed once)."""
    if not torch.cuda.is_available():
        return common.time_ms(fn, warmup=warmup, rep=10 * reps)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    return common.time_ms(fn, warmup=warmup * est, rep=1.05 * reps * est)


def layout(scale=1):
    """Shapes of a 1.23 B-parameter, 290-tensor model (dims divided by ``scale``)."""
    h, kv, inter, vocab = 2048 // scale, 512 // scale, 4864 // scale, 128256 // scale
    shapes = [(vocab, h)]
    for _ in range(24):
        shapes += [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,), (h, h), (inter, h), (inter, h), (h, inter),
                   (h,), (h,)]
    return shapes + [(h,)]


class Flat(nn.Module):
    def __init__(self, shapes, dtype, device):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes])


def bench_copy(device, scale):
    from humanline_kernels.sync._copy import load_extension
    ext = load_extension()
    shapes = layout(scale)
    bw = common.copy_bandwidth_bytes_per_ms(device=device)
    rows = []
    for st, dt in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)]:
        pol, ref = Flat(shapes, st, device), Flat(shapes, dt, device)
        src, dst = [p.data for p in pol.ps], [p.data for p in ref.ps]
        numel = sum(p.numel() for p in src)
        nbytes = numel * (st.itemsize + dt.itemsize)
        syncer = __import__("humanline_kernels").ReferenceSyncer(pol, ref, overlap=False)
        # the tensors are bound as defaults: the names are deleted after the loop (free the memory between layouts)
        impls = {"_foreach_copy_": lambda dst=dst, src=src: torch._foreach_copy_(dst, src),
                 "per-tensor copy_": lambda dst=dst, src=src: [d.copy_(s) for d, s in zip(dst, src)],
                 "ReferenceSyncer.sync()": syncer.sync}
        if ext is not None and device == "cuda":
            stream = torch.cuda.current_stream().cuda_stream
            impls = {"hk kernel": lambda dst=dst, src=src: ext.multi_tensor_copy(dst, src, stream), **impls}
        for name, fn in impls.items():
            ms = common.time_ms(fn)
            rows.append({"impl": name, "src": str(st)[6:], "dst": str(dt)[6:], "params": numel, "tensors": len(src),
                         "ms": ms, "TB/s": nbytes / ms / 1e9, "ratio_to_copy_bw": nbytes / ms / bw})
        del pol, ref, src, dst, syncer, impls
    return rows, {"copy_bw_TBps": bw / 1e9, "kernel": ext is not None}


def bench_overlap(device, scale, gemms, slices=15, rounds=6, calls=5):
    import humanline_kernels as hk
    shapes = layout(scale)
    pol, ref = Flat(shapes, torch.float32, device), Flat(shapes, torch.bfloat16, device)
    n = 8192 if device == "cuda" else 128
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16) / n ** 0.5
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def work():
        for _ in range(gemms):
            torch.mm(a, b)

    def with_sync(s, fwd=work):
        def step():
            s.start()
            fwd()
            s.wait()
        return step

    pol16 = Flat(shapes, torch.bfloat16, device)  # same-dtype groups: the ones the copy engines can take
    # use_kernel=False on the copy-engine path: copy_ per tensor in place of the extension's one batched copy
    fns = {"GEMMs alone": work}
    for name, policy, overlap, engine, kernel in [
            ("GEMMs + overlapped sync", pol, True, False, None),
            ("GEMMs + blocking sync", pol, False, False, None),
            ("GEMMs + overlapped bf16 sync (kernel)", pol16, True, False, None),
            ("GEMMs + overlapped bf16 sync (copy engines, batched)", pol16, True, True, None),
            ("GEMMs + overlapped bf16 sync (copy engines, copy_ per tensor)", pol16, True, True, False)]:
        fns[name] = with_sync(hk.ReferenceSyncer(policy, ref, overlap=overlap, use_kernel=kernel, copy_engine=engine))
    # paced: the syncer hooks the policy's leaf modules, so the GEMMs run as a policy's forward (one leaf each); each
    # paced row has its own chain and syncer, hence its own hooks, since the rows alternate. Timed alone with the
    # hooks on (the GPU-bound chain should hide their host time), then with the sync in ``slices`` parts, one every
    # gemms/slices GEMMs once learned (run 8's pace probe: 15 parts, one per 4 GEMMs)
    paced_ref = Chain(ref.ps, a, b, gemms)
    paced = []
    for name, engine in [(f"GEMMs + overlapped bf16 sync (copy engines, batched, {slices} slices)", True),
                         (f"GEMMs + overlapped bf16 sync (kernel, {slices} slices)", False)]:
        chain = Chain(pol16.ps, a, b, gemms)
        syncer = hk.ReferenceSyncer(chain, paced_ref, slices=slices, copy_engine=engine)
        if engine:
            fns["GEMMs as the paced policy's forward, hooked, alone"] = chain
        fns[name] = with_sync(syncer, chain)
        paced.append((name, syncer))
    ms, by_round = common.interleaved(fns, device, rounds=rounds, calls=calls)
    parts = {name: dict(syncer._pace.issued) for name, syncer in paced}  # where the last step's parts went
    for _, syncer in paced:
        syncer.refresh()  # unhook
    base = ms["GEMMs alone"]
    rows = []
    for name in fns:
        r = by_round[name]
        rows.append({"impl": name, "ms": ms[name], "added_pct": 100 * (ms[name] - base) / base,
                     "spread_pct": 100 * (max(r) - min(r)) / ms[name]})
        if name in parts:
            rows[-1]["parts"] = parts[name]
    return rows, {"gemms": gemms, "gemm_n": n, "params": sum(p.numel() for p in pol.parameters()), "slices": slices,
                  "rounds": rounds, "calls_a_round": calls, "alone_ms_by_round": by_round["GEMMs alone"]}


class Mm(nn.Module):
    """One GEMM, as a leaf module (the paced syncer's hook points)."""

    def forward(self, a, b):
        return torch.mm(a, b)


class Chain(nn.Module):
    """``Flat``'s parameters (never read) and a forward of ``gemms`` GEMMs, each a leaf module."""

    def __init__(self, ps, a, b, gemms):
        super().__init__()
        self.ps = ps
        self.mm = nn.ModuleList(Mm() for _ in range(gemms))
        self.__dict__["ab"] = (a, b)  # not state: the two models must hold the same parameters only

    def forward(self):
        for m in self.mm:
            m(*self.ab)


def bench_fsdp2(device):
    import socket

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import humanline_kernels as hk
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        d, layers, tokens = (4096, 12, 8192) if device == "cuda" else (64, 2, 16)

        def make():
            m = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d)) for _ in range(layers)]).to(device)
            for blk in m:
                fully_shard(blk, mesh=mesh, mp_policy=mp)
            return fully_shard(m, mesh=mesh, mp_policy=mp)

        pol, ref = make(), make()
        opt = torch.optim.AdamW(pol.parameters(), lr=1e-4)
        x = torch.randn(tokens, d, device=device)
        syncer = hk.ReferenceSyncer(pol, ref)
        full = StateDictOptions(full_state_dict=True)

        def step(sync):
            with torch.no_grad():
                ref(x)
            if sync == "ours":
                syncer.start()
            pol(x).float().square().mean().backward()
            if sync == "ours":
                syncer.wait()
            elif sync == "state_dict":
                state_dict_way()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def state_dict_way():
            set_model_state_dict(ref, get_model_state_dict(pol, options=full), options=full)

        rows = []
        for name, sync in [("step alone", None), ("step + overlapped sync", "ours"),
                           ("step + state_dict way", "state_dict")]:
            rows.append({"impl": name, "ms": time_reps(lambda: step(sync))})
        base = rows[0]["ms"]
        for r in rows:
            r["added_pct"] = 100 * (r["ms"] - base) / base
        # the two syncs on their own (blocking), so the ratio does not divide by an overlapped ~0 ms
        ours = time_reps(syncer.sync)
        theirs = time_reps(state_dict_way)
        rows += [{"impl": "our sync alone (blocking)", "ms": ours}, {"impl": "state_dict way alone", "ms": theirs}]
        meta = {"hidden": d, "layers": layers, "tokens": tokens, "params": sum(p.numel() for p in pol.parameters()),
                "state_dict_over_ours": theirs / ours}
        return rows, meta
    finally:
        if own:
            dist.destroy_process_group()


def main(argv=None):
    p = Parser(prog="python -m bench sync", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output directory (default bench/out)")
    p.add_argument("--gemms", type=int, default=60)
    p.add_argument("--slices", type=int, default=15, help="parts of the paced sync rows (default 15)")
    p.add_argument("--skip", nargs="*", default=[], choices=["copy", "overlap", "fsdp2"])
    a = p.parse_args(argv)
    device = "cpu" if a.quick or not torch.cuda.is_available() else "cuda"
    scale = 64 if device == "cpu" else 1
    gemms = 2 if a.quick else a.gemms
    if gemms < 1 or a.slices < 1:
        p.error("--gemms and --slices must be positive")
    if a.slices > a.gemms + 1:  # a part per GEMM at most (the hook points), plus the one at start()
        p.error(f"--slices must be at most --gemms + 1 = {a.gemms + 1}")
    slices = min(a.slices, gemms + 1)  # --quick runs 2 GEMMs
    if "copy" not in a.skip:
        rows, meta = bench_copy(device, scale)
        common.save("sync_copy", rows, {**meta, "device": device}, a.out, bar="ratio_to_copy_bw", label=("src", "dst"))
    if "overlap" not in a.skip:
        rows, meta = bench_overlap(device, scale, gemms, slices)
        common.save("sync_overlap", rows, {**meta, "device": device}, a.out, bar="added_pct")
    if "fsdp2" not in a.skip:
        rows, meta = bench_fsdp2(device)
        print(f"state_dict way / our sync (each alone, blocking): {meta['state_dict_over_ours']:.3g}x")
        common.save("sync_fsdp2", rows, {**meta, "device": device}, a.out, bar="ms")
    return 0

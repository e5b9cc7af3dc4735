"""Peak memory of one fused-linear forward + backward at the real shape (N = 8192, D = 4096, V = 128256, bf16),
counted on the CPU without a GPU (bench/live_bytes.py: meta tensors, Triton launches stubbed, a dispatch mode that
tracks storages), so that memory cannot regress unseen; and issue 54's target 2, peak at most the lm_head GEMM
floor's + 0.25 GiB, met since ``dW`` accumulates in the weight's dtype and is handed to autograd in place (no fp32
``[V, D]`` buffer, no second ``[V, D]`` in the backward).

The numbers follow ``bench linear``'s protocol (the previous call's gradients freed inside the call). The counter
is checked three ways: a sequence whose peak is known by hand, the CPU allocator's own peak for the same calls
on real tensors, and run 3's H100 measurement (bench/results/2026-11-26-h100/linear.json), which the counter
equalled to the byte on the code of that run (2.0195 GiB for each loss, 2.4569 for ``token_logprobs``).
"""
import pytest
import torch

from bench import live_bytes as LB
from bench.host_proxy import stubbed_launches

GiB = 1 << 30
# today's peaks, bytes, counted (not yet measured on a GPU). Lower one after a change that saves memory. Run 3's
# code (its H100 measurement): 2168456192 for each loss, 2638035968 for token_logprobs.
TODAY = {"grpo": 525600768, "dpo": 542346240, "kto": 525569536, "token_logprobs": 536689664}
FLOOR = 1050673152  # the floor's dW GEMM output, 128256 x 4096 bf16: run 3's 0.978515625 GiB
TARGET = FLOOR + GiB // 4


def _compiled_launches():
    from humanline_kernels.ops import _jit
    return sum(n for (path, _), n in _jit.LAUNCHES.items() if path == "compiled")


@pytest.fixture(scope="module")
def real():
    before = _compiled_launches()
    rows, meta = LB.measure()
    return {r["impl"]: r for r in rows}, meta, _compiled_launches() - before


def test_counter_on_a_sequence_known_by_hand():
    """Views, ``out=`` and in-place results are not allocations; a storage lives while any view of it does; every
    block rounds to 512 bytes; autograd's saved tensors and gradients count."""
    x = torch.empty(1000, device="meta", requires_grad=True)  # an input: not counted

    def fn():
        a = torch.empty(1000, device="meta")  # 4000 -> 4096
        v = a[8:].view(-1, 8)
        torch.mul(v, 2, out=v)
        v.add_(1)
        del a  # v keeps the storage
        b = torch.empty(3000, dtype=torch.bfloat16, device="meta")  # 6000 -> 6144: 10240 live
        del v  # 4096 freed
        c = b.float()  # 12000: 18432 live, the peak
        del b, c
        y = x.exp()  # 4000 -> 4096, saved for the backward
        y.sum().backward()  # the sum and autograd's seed (512 each), their expand (a view), the grad: 9216 live
    with LB.LiveBytes() as mem:
        fn()
    assert mem.peak == 18432 and mem.now() == 4096  # x.grad stays
    x.grad = None
    with LB.LiveBytes() as mem:  # exp (saved) 4096, sum 512, seed 512, the slice's grad as zeros of x's shape 4096,
        x.exp()[:500].sum().backward()  # then exp's grad 4096 while that one is still alive
    assert mem.peak == 4096 + 512 + 512 + 4096 + 4096


def test_counter_equals_the_cpu_allocator():
    """The same calls on real fp32 CPU tensors (compiled-kernel branch, launches stubbed): the counter's peak is
    the allocator's own to the byte (fp32: CPU GEMMs in bf16 allocate packed copies inside the op, which no
    aten-level count sees and cuBLAS does not make)."""
    try:
        LB.allocator_peak(lambda: torch.empty(1))
    except Exception as e:  # pragma: no cover - the profiler's private results API moved
        pytest.skip(f"no profiler memory events here: {type(e).__name__}: {e}")
    B, T, D, V = 2, 16, 64, 512
    with stubbed_launches(devices=("cpu",)):
        h, w, *rest = LB.inputs(B, T, D, V, torch.float32, "cpu")
        fns, _ = LB.cases(h, w, *rest, chunk_bytes=8 * V * 4)  # several chunks
        for name, fn in fns.items():
            fn()
            h.grad = w.grad = None  # the allocator's count cannot see frees of earlier blocks: a fresh call
            with LB.LiveBytes(granule=1) as mem:
                fn()
            h.grad = w.grad = None
            assert mem.extra == LB.allocator_peak(fn), name


def test_small_shape_by_hand():
    """Today's design at a small shape: the peak is in the forward's last chunk, where dW (bf16, the weight's dtype),
    the chunk's logits buffer, dh and the per-token [B, T] planes are alive; the backward allocates nothing of
    [V, D] or [N, D] size (it scales dh and dW in place and hands them to autograd). So the peak over the baseline
    is the logits buffer and the planes: the previous call's dh and dW (bf16) were freed first, and this call's
    replace them. The floor's peak is its dW GEMM's output."""
    B, T, D, V = 2, 16, 64, 512
    N = B * T
    rows, _ = LB.measure(B, T, D, V, chunk_bytes=8 * V * 2, names=("floor", "grpo", "dpo", "kto", "token_logprobs"))
    floor, *ours = rows
    assert floor["peak_extra_bytes"] == V * D * 2
    for r in ours:
        buf = {"dpo": 2 * T, "kto": T}.get(r["impl"], 8) * V * 2  # at least one pair (DPO) or row (KTO) a chunk
        planes = r["peak_fresh_bytes"] - (V * D * 2 + buf + N * D * 2)
        assert 0 <= planes <= 8 * 1024, (r["impl"], planes)  # a few [B, T] fp32 planes, 512-byte blocks
        assert r["peak_extra_bytes"] == r["peak_fresh_bytes"] - (N * D * 2 + V * D * 2), r["impl"]
        big = [e for e in r["at_peak"] if e[0] >= V * D * 2]  # one [V, D]: dW, in bf16
        assert big == [[V * D * 2, "bfloat16", (V, D), "empty.memory_format"]], r["impl"]
        if r["impl"] != "token_logprobs":  # (which forms its gradients in the backward)
            assert r["backward_bytes"] is None or r["backward_bytes"] < r["forward_bytes"], r["impl"]


def test_real_shape_floor_is_run3s(real):
    rows, meta, launches = real
    assert launches > 0  # the compiled-kernel branch ran (as on a GPU), not the eager twins
    assert (meta["N"], meta["D"], meta["V"], meta["dtype"]) == (8192, 4096, 128256, "torch.bfloat16")
    assert rows["floor"]["peak_extra_bytes"] == FLOOR == meta["floor_bytes"]
    assert meta["target_bytes"] == TARGET


@pytest.mark.parametrize("loss", sorted(TODAY))
def test_real_shape_peak_at_most_today(real, loss):
    peak = real[0][loss]["peak_extra_bytes"]
    assert peak <= TODAY[loss], f"{loss}: {peak / GiB:.4f} GiB, above today's {TODAY[loss] / GiB:.4f} GiB"


@pytest.mark.parametrize("loss", LB.LOSSES)
def test_real_shape_peak_meets_the_target(real, loss):
    peak = real[0][loss]["peak_extra_bytes"]
    assert peak <= TARGET, f"{loss}: {peak / GiB:.4f} GiB over the target {TARGET / GiB:.4f} GiB"


def test_cli_writes_the_table(tmp_path, capsys):
    """``python -m bench linear --live-bytes`` (any shape): the table and ``linear_live_bytes.json``."""
    import json

    from bench import bench_linear
    args = ["--live-bytes", "--rows", "2", "--T", "16", "--D", "64", "--V", "512", "--chunk-mib", "1"]
    assert bench_linear.main(args + ["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "linear_live_bytes.json").read_text())
    rows = {r["impl"]: r for r in data["rows"]}
    assert set(rows) == {"floor", *LB.LOSSES, "token_logprobs"}
    assert data["meta"]["target_bytes"] == data["meta"]["floor_bytes"] + GiB // 4 == 64 * 512 * 2 + GiB // 4
    assert rows["grpo"]["meets_target"] is True and rows["token_logprobs"]["target_GiB"] is None
    assert "peak_extra" in capsys.readouterr().out

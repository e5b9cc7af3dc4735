"""Issue 53, target 2, a bare calibration: can GRPO's gradient in the forward reach 1.15x the 2-pass floor when a
row is split over a group of programs that exchange max and sum-exp through a small workspace?

Why (bench/NOTES.md, run 8): today's kernel sweeps each row twice in one program (stats, then the gradient), moves
1.10x the 2-pass bytes (the re-read mostly hits L1/L2) and still takes 1.47x the floor on an H100, because one
program an SM keeps 16 KiB in flight: HBM runs at 66 %. Pipelining the sweep (cp.async) dropped the L1 hits and
`evict_last` and moved 1.33x the bytes. Here a row of V logits is cut into C = cdiv(V, CHUNK) chunks, one program
each. A program loads its whole chunk at once (CHUNK elements in flight, held in registers), publishes its chunk's
max and sum-exp, counts itself in (an atomic with release semantics), spins until the row's C programs are in
(acquire), combines the C partials into the row's log-sum-exp, and writes its chunk's gradient from the registers.
Every logit is read from HBM once and every gradient written once: exactly the 2-pass floor's bytes.

The math (one token, its row x of V logits, temperature t, label y, reference log-prob r, advantage a):
    lse = logsumexp(x / t),   logp = x_y / t - lse,   loss = -exp(logp - r) * a   (GRPO's ratio term)
    d loss / d x_j = coef * (1[j = y] - softmax(x / t)_j) / t,   coef = -exp(logp - r) * a
checked against torch in fp32 for every configuration.

Progress: grid order. CUDA starts blocks in increasing index, so the programs of a row start after those of every
earlier row, which finish without waiting on later ones: no deadlock while C programs fit on the GPU at once. The spin
is bounded all the same (SPIN_LIMIT polls): a program that gives up sets a flag, and the configuration is reported
as failed, not hung.

Usage: python bench/probes/gif_split.py OUT [--vocab V ...] [--quick]. Writes OUT/gif_split.json and prints a table:
per V and (CHUNK, num_warps), ms, ratio to the 2-pass floor (2 x N x V x 2 bytes at the bandwidth of a 1 GiB
copy_ measured in the same run), max error against torch; beside them the package's own gradient-in-forward call
(``hk.fused.grpo(grad_in_forward=True)``, forward + autograd.grad as ``bench logits`` times it) and a two-sweep
one-program-a-row bare kernel as controls. A record of what ran; compiled here for sm_90 and sm_80
(``--compile-only 90`` / ``80``) before any GPU saw it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
import triton.language as tl

SPIN_LIMIT = tl.constexpr(1 << 22)  # polls before a program gives up
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@triton.jit
def _split_kernel(x_ptr, y_ptr, r_ptr, adv, out_ptr, logp_ptr, ws_ptr, cnt_ptr, err_ptr, V, inv_t, target,
                  C: tl.constexpr, CP: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // C
    c = pid % C
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    base = x_ptr + row * V
    x = tl.load(base + offs, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    tl.store(ws_ptr + (row * C + c) * 2, m)
    tl.store(ws_ptr + (row * C + c) * 2 + 1, s)
    tl.debug_barrier()  # whichever threads stored the partials, before the one that counts the program in
    tl.atomic_add(cnt_ptr + row, 1, sem="release")
    n = tl.atomic_add(cnt_ptr + row, 0, sem="acquire")
    polls = 0
    while (n < target) & (polls < SPIN_LIMIT):
        n = tl.atomic_add(cnt_ptr + row, 0, sem="acquire")
        polls += 1
    tl.debug_barrier()
    if n < target:
        tl.atomic_add(err_ptr, 1)
    k = tl.arange(0, CP)  # C rounded up to a power of two
    ms = tl.load(ws_ptr + (row * C + k) * 2, mask=k < C, other=-float("inf"), cache_modifier=".cg")
    ss = tl.load(ws_ptr + (row * C + k) * 2 + 1, mask=k < C, other=0.0, cache_modifier=".cg")
    big = tl.max(ms, 0)
    lse = big + tl.log(tl.sum(ss * tl.exp(ms - big), 0))
    y = tl.load(y_ptr + row)
    logp = tl.load(base + y).to(tl.float32) * inv_t - lse
    coef = -tl.exp(logp - tl.load(r_ptr + row)) * adv
    if c == 0:
        tl.store(logp_ptr + row, logp)
    g = coef * inv_t * (tl.where(offs == y, 1.0, 0.0) - tl.exp(x - lse))
    tl.store(out_ptr + row * V + offs, g.to(out_ptr.dtype.element_ty), mask=mask, eviction_policy="evict_first")


@triton.jit
def _two_sweep_kernel(x_ptr, y_ptr, r_ptr, adv, out_ptr, logp_ptr, V, inv_t, BLOCK: tl.constexpr):
    """The control: one program a row, a stats sweep (evict_last) then a gradient sweep re-reading the row."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    m = tl.full([BLOCK], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=-float("inf"), eviction_policy="evict_last").to(tl.float32)
        x = x * inv_t
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    big = tl.max(m, 0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), 0))
    y = tl.load(y_ptr + row)
    logp = tl.load(base + y).to(tl.float32) * inv_t - lse
    coef = -tl.exp(logp - tl.load(r_ptr + row)) * adv
    tl.store(logp_ptr + row, logp)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=0.0).to(tl.float32) * inv_t
        g = coef * inv_t * (tl.where(offs == y, 1.0, 0.0) - tl.exp(x - lse))
        tl.store(out_ptr + row * V + offs, g.to(out_ptr.dtype.element_ty), mask=offs < V,
                 eviction_policy="evict_first")


CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (8192, 16), (16384, 8), (16384, 16)]


def split(x, y, r, adv, inv_t, chunk, warps, ws=None, cnt=None, err=None, out=None, logp=None, gen=1):
    """One launch. The row counters are never reset: launch ``gen`` (1, 2, ... on the same ``cnt``) waits until a
    row's counter reaches ``gen * C``, so no memset runs beside the kernel (as a real kernel would have it)."""
    N, V = x.shape
    C = triton.cdiv(V, chunk)
    out = torch.empty_like(x) if out is None else out
    logp = torch.empty(N, device=x.device) if logp is None else logp
    ws = torch.empty(N * C * 2, device=x.device) if ws is None else ws
    cnt = torch.zeros(N, device=x.device, dtype=torch.int32) if cnt is None else cnt
    err = torch.zeros(1, device=x.device, dtype=torch.int32) if err is None else err
    _split_kernel[(N * C,)](x, y, r, adv, out, logp, ws, cnt, err, V, inv_t, gen * C, C=C,
                            CP=triton.next_power_of_2(C), CHUNK=chunk, num_warps=warps)
    return out, logp, err


def two_sweep(x, y, r, adv, inv_t, out=None, logp=None, block=4096, warps=8):
    N, V = x.shape
    out = torch.empty_like(x) if out is None else out
    logp = torch.empty(N, device=x.device) if logp is None else logp
    _two_sweep_kernel[(N,)](x, y, r, adv, out, logp, V, inv_t, BLOCK=block, num_warps=warps)
    return out, logp


def reference(x, y, r, adv, inv_t):
    z = x.float() * inv_t
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, y[:, None].long())[:, 0] - lse
    coef = -torch.exp(logp - r) * adv
    onehot = torch.nn.functional.one_hot(y.long(), x.shape[1]).float()
    return coef[:, None] * inv_t * (onehot - torch.softmax(z, -1)), logp


def compile_only(arch):
    """Build every configuration for sm_<arch> with the wheel's ptxas, without a GPU, through Triton's own launch path
    on ``meta`` tensors (the compile gate's stand-in driver: the launch specialises as at run time); print
    registers, spills (``ptxas -v``), 16-byte loads and the acquire/release accesses in the PTX."""
    sys.path.insert(0, ROOT)
    from tools.compile_gate import _install, _resources
    compiled, ok = [], True
    _install(arch, compiled)
    N, V = 8, 128256
    x = torch.empty(N, V, device="meta", dtype=torch.bfloat16)
    y = torch.empty(N, device="meta", dtype=torch.int32)
    r = torch.empty(N, device="meta")
    for chunk, warps in CONFIGS:
        compiled.clear()
        try:
            split(x, y, r, 0.8, 1 / 0.7, chunk, warps)
            (_, k), = compiled
            regs, stack, spill_st, spill_ld = _resources(k, arch)
            ptx = k.asm["ptx"]
            # (Triton lowers an unused release add to red.release, an acquire add of 0 to ld.acquire)
            atoms = sorted(set(re.findall(r"(?:atom|red|ld)\.global\.gpu\.(?:acquire|release|acq_rel)[\w.]*", ptx)))
            v4 = len(re.findall(r"ld\.global[.:\w]*\.v4", ptx))
            print(f"sm_{arch} CHUNK={chunk:6d} warps={warps:2d}: {regs} registers, stack {stack}, spills "
                  f"{spill_st}/{spill_ld}, {v4} 16-byte loads, ordered accesses {atoms}", flush=True)
            ok &= stack == spill_st == spill_ld == 0
        except Exception as e:  # report every configuration
            print(f"sm_{arch} CHUNK={chunk} warps={warps}: {type(e).__name__}: {e}", flush=True)
            ok = False
    return 0 if ok else 1


INV_T, ADV = 1 / 0.7, 0.8


def problem(N, V, bw):
    """The probes' inputs at one V (seeded), the 2-pass floor in ms, torch's answer, and the output buffers:
    ``(x, y, r, floor, g_ref, lp_ref, out, logp)`` (shared with gif_cluster.py)."""
    dev = "cuda"
    torch.manual_seed(V)
    x = torch.randn(N, V, device=dev, dtype=torch.bfloat16) * 3
    y = torch.randint(0, V, (N,), device=dev, dtype=torch.int32)
    r = torch.randn(N, device=dev) * 0.1 - 12
    g_ref, lp_ref = reference(x, y, r, ADV, INV_T)
    return x, y, r, 2 * N * V * 2 / bw, g_ref, lp_ref, torch.empty_like(x), torch.empty(N, device=dev)


def measure(N, V, bw, hk, do_bench):
    """Every configuration at one V: rows for the JSON (ms, ratio to the 2-pass floor, errors against torch)."""
    dev, inv_t, adv, rows = "cuda", INV_T, ADV, []
    x, y, r, floor, g_ref, lp_ref, out, logp = problem(N, V, bw)

    def row(name, ms, err=None, **kw):
        d = {"V": V, "impl": name, "ms": ms, "floor2_ms": floor, "ratio_2pass": ms / floor, **kw}
        if err is not None:
            d["max_abs_err_grad"], d["max_abs_err_logp"] = err
        rows.append(d)
        print(f"V={V:6d} {name:34s} {ms:7.3f} ms  {ms / floor:5.3f}x 2-pass floor"
              + ("" if err is None else f"  err grad {err[0]:.2e} logp {err[1]:.2e}") + f"  {kw or ''}", flush=True)

    def errors():
        return ((out.float() - g_ref).abs().max().item(), (logp - lp_ref).abs().max().item())
    for chunk, warps in CONFIGS:
        C = triton.cdiv(V, chunk)
        ws = torch.empty(N * C * 2, device=dev)
        cnt = torch.zeros(N, device=dev, dtype=torch.int32)
        err = torch.zeros(1, device=dev, dtype=torch.int32)
        name = f"split CHUNK={chunk} warps={warps}"
        gen = [1]

        def launch():
            split(x, y, r, adv, inv_t, chunk, warps, ws, cnt, err, out, logp, gen[0])  # noqa: B023
            gen[0] += 1  # noqa: B023
        try:
            out.zero_()
            launch()
            torch.cuda.synchronize()
            e, first = errors(), int(err.item())
            ms = do_bench(launch, warmup=25, rep=100, return_mode="median")
            row(name, ms, e, C=C, spin_timeouts_first=first, spin_timeouts_all=int(err.item()), launches=gen[0] - 1)
        except Exception as ex:  # report every configuration
            rows.append(failed(V, name, ex))
    out.zero_()
    two_sweep(x, y, r, adv, inv_t, out, logp)
    torch.cuda.synchronize()
    row("two-sweep control (1 program/row)", do_bench(lambda: two_sweep(x, y, r, adv, inv_t, out, logp), warmup=25,
                                                       rep=100, return_mode="median"), errors())
    xg = x.view(1, N, V).detach().requires_grad_()
    ref_lp, advs, yy = r.view(1, N), torch.tensor([adv], device=dev), y.view(1, N).long()

    from humanline_kernels.ops import tuning

    def ours():  # the Triton kernel the option names, whatever the tuned table chose for this card
        with tuning.forced_path("triton"):
            return torch.autograd.grad(hk.fused.grpo(xg, yy, ref_lp, advs, beta=0.04, validate=False,
                                                     grad_in_forward=True)[0], xg)[0]
    # the package's own call, forward + autograd.grad as bench logits times it (its loss: temperature 1, clip,
    # beta 0.04, a new gradient buffer): the same bytes, not the same math, so no error column
    row("hk.fused.grpo(grad_in_fwd)", do_bench(ours, warmup=25, rep=100, return_mode="median"))
    return rows


def failed(V, name, ex):
    """The row of a configuration that raised, printed as it goes (both probes report every configuration)."""
    msg = f"{type(ex).__name__}: {str(ex)[:200]}"
    print(f"V={V:6d} {name}: {msg}", flush=True)
    return {"V": V, "impl": name, "error": msg}


def sweep(out, fname, tokens, vocab, measure, **meta):
    """Both probes' run: ``measure(V, bw)``'s rows at each V, written to ``OUT/fname`` after each V (a run cut short
    keeps its rows), with the GPU, the versions and the bandwidth of a 1 GiB ``copy_`` measured in the same run (the
    floors' rate)."""
    from bench import common
    bw = common.copy_bandwidth_bytes_per_ms(device="cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **meta, "N": tokens,
           "copy_bandwidth_TBps": bw * 1e3 / 1e12, "rows": []}
    for V in vocab:
        res["rows"] += measure(V, bw)
        torch.cuda.empty_cache()
        with open(os.path.join(out, fname), "w") as f:
            json.dump(res, f, indent=1)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="gif_split.py", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None)
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 151936, 32000])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--compile-only", type=int, metavar="ARCH", help="build for sm_ARCH (90, 80) here, no GPU")
    a = p.parse_args(argv)
    if a.compile_only:
        return compile_only(a.compile_only)
    if a.out is None or not torch.cuda.is_available():
        p.error("needs OUT and a CUDA device (or --compile-only)")
    sys.path.insert(0, ROOT)
    from triton.testing import do_bench

    import humanline_kernels as hk
    return sweep(a.out, "gif_split.json", a.tokens, a.vocab, lambda V, bw: measure(a.tokens, V, bw, hk, do_bench),
                 triton=triton.__version__)


if __name__ == "__main__":
    sys.exit(main())

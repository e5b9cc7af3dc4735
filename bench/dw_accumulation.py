"""The error of accumulating the fused-linear ``dW`` in the weight's dtype (bf16), measured against fp32
accumulation, at the bench's vocabulary and token count (``python -m bench.dw_accumulation``; issue 54, target 2).

The fused-linear losses form ``dW = sum_c dz_c^T h_c`` over chunks ``c`` of tokens, one GEMM a chunk. Each GEMM
accumulates its chunk's ``n`` tokens in fp32 (cuBLAS's compute type; the CPU's bf16 GEMM too) and writes its
output once: into an fp32 ``[V, D]`` buffer (the design before issue 54: ``dW`` rounded to bf16 once, at the end)
or straight into the bf16 ``dW`` (``beta = 1``: the previous partial sum read as bf16, added in fp32, rounded
once), i.e. one bf16 rounding per chunk. Only that rounding differs between the two, so this measures it alone.

What is modelled (all from a seed, on the CPU, ~2 min on 2 cores):

* ``N = 8192`` tokens (8 rows of 1024, the first quarter of each row a prompt, ignored), ``V = 128256``; logits
  ``z = h W^T + b`` from ``hidden [N, 1024]`` (the logits' inner dimension does not enter the accumulation: each
  ``dW[v, d]`` sums ``dz[t, v] h[t, d]`` over tokens) and a bf16 ``weight``; ``b`` a Zipf log-frequency over the
  vocabulary; every token's hidden state points at an intended token (Zipf-drawn) by a margin that varies by token,
  so distributions range from peaked to flat (the mean entropy is printed); labels are sampled from the model's
  own softmax, as GRPO's completions are. Logits are rounded to bf16 (the chunk buffer's dtype).
* ``dz = g (onehot(y) - softmax(z))`` rounded to bf16 (the row kernel's in-place output), with ``g`` the loss's
  per-token coefficient: GRPO (``dapo``, on-policy so ``rho = 1``: ``g = -A_row / sum m``, advantages of a group of
  8 normalised to mean 0, std 1: signs change between rows) and SFT / DPO's chosen side (``g = -1 / sum m``, one
  sign: partial sums grow monotonically, the mildest case).
* ``dW`` for 256 of the hidden columns and every vocabulary row: per 128 tokens an fp32 product; for a chunk of
  ``n`` tokens (``k = N / n`` chunks) their fp32 sum is that chunk's GEMM; the fp32 path sums the chunks in fp32 and
  rounds once, the bf16 path rounds after every chunk; the truth sums in fp64.

Printed and written (``--out``, default bench/out/dw_accumulation.json): per case and ``k``, the relative norm
error ``||dW - ref|| / ||ref||`` of the bf16 accumulation against the fp32 accumulation's result (before its final
rounding, and rounded to bf16 as it is returned) and against the fp64 truth, and the fp32 path's own error (its
final rounding). bench linear's default (512 MiB chunks of a 128256 vocabulary in bf16) is 2048 tokens: ``k = 4``.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from .cli import Parser

N_ROWS, T, V, D_LOGITS, D_MEAS = 8, 1024, 128256, 1024, 256
PROMPT = T // 4
BLOCK = 128  # tokens per fp32 product; a chunk is a whole number of them
CHUNKS = (8192, 4096, 2048, 1024, 512, 256, 128)  # tokens per chunk: k = 1 .. 64
V_SLICE = 8192


def _model(seed, D=D_LOGITS, margin_max=18.0):
    """``(h [N, D] bf16, z [N, V] bf16, y [N], mask [N])`` of the synthetic model described in the docstring."""
    g = torch.Generator().manual_seed(seed)
    N = N_ROWS * T
    sigma = 1.5 / math.sqrt(D)  # noise logits ~ N(0, 1.5^2)
    W = (torch.randn(V, D, generator=g) * sigma).bfloat16()
    ranks = torch.randperm(V, generator=g)
    logf = -1.1 * torch.log(ranks.double() + 2.7)  # Zipf-Mandelbrot log-frequency
    b = (logf - logf.max()).float() * 1.0
    zipf = torch.softmax(logf, 0)
    intended = torch.multinomial(zipf.float(), N, replacement=True, generator=g)
    margin = torch.rand(N, generator=g) * margin_max  # the intended token's extra logit: flat to peaked
    Wi = W[intended].float()
    h = torch.randn(N, D, generator=g) + margin[:, None] * Wi / Wi.pow(2).sum(1, keepdim=True)
    h = h.bfloat16()
    z = torch.empty(N, V, dtype=torch.bfloat16)
    for s in range(0, V, V_SLICE):  # bf16 GEMM (fp32 inside), bias added in fp32, rounded once
        e = min(V, s + V_SLICE)
        z[:, s:e] = (torch.mm(h, W[s:e].t()).float() + b[s:e]).bfloat16()
    # labels sampled from the model's softmax (Gumbel-max over the slices)
    best = torch.full((N,), -float("inf"))
    y = torch.zeros(N, dtype=torch.long)
    for s in range(0, V, V_SLICE):
        e = min(V, s + V_SLICE)
        u = torch.rand(N, e - s, generator=g).clamp_(1e-20, 1.0)
        m, i = (z[:, s:e].float() - torch.log(-torch.log(u))).max(1)
        upd = m > best
        best = torch.where(upd, m, best)
        y = torch.where(upd, i + s, y)
    mask = (torch.arange(N) % T) >= PROMPT
    return h, z, y, mask, g


def _lse_entropy(z):
    mx = torch.full((z.shape[0],), -float("inf"))
    for s in range(0, V, V_SLICE):
        mx = torch.maximum(mx, z[:, s:s + V_SLICE].float().max(1).values)
    acc = torch.zeros(z.shape[0], dtype=torch.float64)
    ez = torch.zeros(z.shape[0], dtype=torch.float64)
    for s in range(0, V, V_SLICE):
        zz = z[:, s:s + V_SLICE].float() - mx[:, None]
        ex = zz.exp()
        acc += ex.sum(1).double()
        ez += (ex * zz).sum(1).double()
    lse = (mx.double() + acc.log()).float()
    ent = (acc.log() - ez / acc).float()
    return lse, ent


def measure(seed=0, chunks=CHUNKS, margin_max=18.0, device="cpu", log=print):
    t0 = time.time()
    h, z, y, mask, g = _model(seed, margin_max=margin_max)
    lse, ent = _lse_entropy(z)
    N = h.shape[0]
    lp = z.gather(1, y[:, None])[:, 0].float() - lse
    log(f"model: {time.time() - t0:.0f} s; mean entropy {ent[mask].mean():.2f} nats, mean label log-prob "
        f"{lp[mask].mean():.2f}, label p > 0.5 on {(lp[mask].exp() > 0.5).float().mean():.0%} of the tokens")
    adv = torch.randn(N_ROWS, generator=g).double()
    adv = ((adv - adv.mean()) / adv.std()).float()
    cnt = float(mask.sum())
    coefs = {"grpo": torch.where(mask, -adv.repeat_interleave(T) / cnt, 0.0),
             "sft": torch.where(mask, torch.full((N,), -1.0 / cnt), 0.0)}
    hm = h[:, 1:1 + D_MEAS].float()
    hd = h[:, 1:1 + D_MEAS].contiguous().to(device)  # bf16, for the real GEMMs
    nb = N // BLOCK
    sums = {c: {k: {"sq_truth": 0.0, "sq_16_32": 0.0, "sq_16_32r": 0.0, "sq_16_t": 0.0, "sq_32_t": 0.0,
                    "sq_gemm_model": 0.0, "sq_gemm_t": 0.0, "gemm_equal": 0, "n": 0, "rows": []} for k in chunks}
            for c in coefs}
    for s in range(0, V, V_SLICE):
        e = min(V, s + V_SLICE)
        p = (z[:, s:e].float() - lse[:, None]).exp()
        onehot = torch.zeros_like(p)
        inside = (y >= s) & (y < e)
        onehot[inside.nonzero()[:, 0], (y[inside] - s)] = 1.0
        for c, coef in coefs.items():
            dz = (coef[:, None] * (onehot - p)).bfloat16().float()
            P = torch.stack([dz[j * BLOCK:(j + 1) * BLOCK].t() @ hm[j * BLOCK:(j + 1) * BLOCK] for j in range(nb)])
            dzd = dz.bfloat16().to(device)  # (exact: dz is bf16-valued)
            truth = P.double().sum(0)
            for n in chunks:
                per = n // BLOCK
                Q = [P[i * per:(i + 1) * per].sum(0) for i in range(N // n)]  # fp32: each chunk's GEMM
                a32 = Q[0].clone()
                a16 = Q[0].bfloat16()
                for q in Q[1:]:
                    a32 += q
                    a16 = (a16.float() + q).bfloat16()
                r32 = a32.bfloat16().double()
                # the real thing: the chunked bf16 accumulation as the package runs it, on `device`
                real = torch.empty(e - s, D_MEAS, dtype=torch.bfloat16, device=device)
                for i in range(N // n):
                    real.addmm_(dzd[i * n:(i + 1) * n].t(), hd[i * n:(i + 1) * n], beta=0 if i == 0 else 1)
                real = real.cpu().double()
                f16 = a16.double()
                acc = sums[c][n]
                acc["sq_truth"] += float(truth.pow(2).sum())
                acc["sq_16_32"] += float((f16 - a32.double()).pow(2).sum())
                acc["sq_16_32r"] += float((f16 - r32).pow(2).sum())
                acc["sq_16_t"] += float((f16 - truth).pow(2).sum())
                acc["sq_32_t"] += float((r32 - truth).pow(2).sum())
                acc["sq_gemm_model"] += float((real - f16).pow(2).sum())
                acc["sq_gemm_t"] += float((real - truth).pow(2).sum())
                acc["gemm_equal"] += int((real == f16).sum())
                acc["n"] += real.numel()
                # per vocabulary row: ||error|| and ||truth|| (the row's relative error, against fp32 -> bf16)
                acc["rows"].append(torch.stack([(f16 - r32).norm(dim=1), truth.norm(dim=1)]).float())
        log(f"  vocabulary rows {s}..{e}: {time.time() - t0:.0f} s")
    rows = []
    for c in coefs:
        for n in chunks:
            a = sums[c][n]
            den = math.sqrt(a["sq_truth"])
            err, nrm = torch.cat(a["rows"], 1)
            keep = nrm > 1e-3 * nrm.max()  # rows whose gradient is not negligible against the largest row's
            rel = (err[keep] / nrm[keep]).double()
            rows.append({"case": c, "tokens_per_chunk": n, "k": N // n,
                         "bf16_vs_fp32_acc": math.sqrt(a["sq_16_32"]) / den,
                         "bf16_vs_fp32_acc_rounded": math.sqrt(a["sq_16_32r"]) / den,
                         "bf16_vs_truth": math.sqrt(a["sq_16_t"]) / den,
                         "fp32_rounded_vs_truth": math.sqrt(a["sq_32_t"]) / den,
                         "gemm_vs_model": math.sqrt(a["sq_gemm_model"]) / den,
                         "gemm_vs_truth": math.sqrt(a["sq_gemm_t"]) / den,
                         "gemm_equal_to_model": a["gemm_equal"] / a["n"],
                         "row_rel_vs_fp32_rounded_p50": float(rel.quantile(0.5)),
                         "row_rel_vs_fp32_rounded_p99": float(rel.quantile(0.99)),
                         "row_rel_vs_fp32_rounded_max": float(rel.max()), "rows_counted": int(keep.sum())})
    meta = {"N": N, "rows": N_ROWS, "T": T, "prompt": PROMPT, "V": V, "D_logits": D_LOGITS, "D_measured": D_MEAS,
            "seed": seed, "margin_max": margin_max, "mean_entropy": float(ent[mask].mean()),
            "mean_label_logp": float(lp[mask].mean()), "torch": torch.__version__, "gemm_device": _device_name(device)}
    return rows, meta


def _device_name(device):
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    import platform
    return f"cpu ({platform.processor() or platform.machine()})"


def table(rows):
    lines = [f"{'case':5s} {'k':>3s} {'tokens':>6s} {'vs fp32 acc':>12s} {'vs fp32->bf16':>14s} {'vs truth':>10s} "
             f"{'fp32->bf16 vs truth':>20s} {'row p50':>9s} {'row p99':>9s} {'row max':>9s} {'GEMM vs model':>14s} "
             f"{'GEMM = model':>12s}"]
    for r in rows:
        lines.append(f"{r['case']:5s} {r['k']:3d} {r['tokens_per_chunk']:6d} {r['bf16_vs_fp32_acc']:12.2e} "
                     f"{r['bf16_vs_fp32_acc_rounded']:14.2e} {r['bf16_vs_truth']:10.2e} "
                     f"{r['fp32_rounded_vs_truth']:20.2e} {r['row_rel_vs_fp32_rounded_p50']:9.2e} "
                     f"{r['row_rel_vs_fp32_rounded_p99']:9.2e} {r['row_rel_vs_fp32_rounded_max']:9.2e} "
                     f"{r['gemm_vs_model']:14.2e} {r['gemm_equal_to_model']:12.4%}")
    return "\n".join(lines)


def main(argv=None):
    p = Parser(prog="python -m bench.dw_accumulation", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join("bench", "out"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin-max", type=float, default=18.0,
                   help="the intended token's extra logit is uniform in [0, this]: larger, more peaked distributions")
    p.add_argument("--device", default="cpu",
                   help="where the real chunked bf16 GEMMs run (cuda: cuBLAS's rounding against the model's); the "
                        "model itself is drawn on the CPU, so every device sees the same numbers")
    a = p.parse_args(argv)
    rows, meta = measure(a.seed, margin_max=a.margin_max, device=a.device)
    print(table(rows))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"dw_accumulation_seed{a.seed}_margin{a.margin_max:g}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

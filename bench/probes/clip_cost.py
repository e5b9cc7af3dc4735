"""Run 9's follow-up: on the H200 every humanline e2e arm, lookahead included (which copies nothing), was ~2.8 %
over offline_ref (H100, run 8: lookahead 1.005x), so something besides the sync differs: the arms' loss calls
differ only in ``clip`` (offline_ref None, humanline HumanlineClip()). Times hk.fused_linear.dpo forward + backward
at bench e2e's lm_head shape (B = 8, T = 1023, D = 2048, V = 128256, bf16, the prompt half ignored) with clip None
and with the default clip, interleaved rounds; prints a JSON line per round and the medians."""
import json
import statistics

import torch

import humanline_kernels as hk


def main():
    torch.manual_seed(0)
    B, T, D, V = 8, 1023, 2048, 128256
    hidden = (torch.randn(B, T, D, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(V, D, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (B, T), device="cuda")
    labels[:, :511] = -100
    with torch.no_grad():
        ref = hk.fused_linear.token_logprobs_nograd(hidden, weight, labels, validate=False)
    arms = {"clip=None": None, "clip=HumanlineClip()": hk.HumanlineClip()}

    def once(clip):
        loss = hk.fused_linear.dpo(hidden, weight, labels, ref, clip=clip, validate=False)[0]
        loss.backward()
        hidden.grad = weight.grad = None

    def timed(clip, n=10):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for k in range(n):
            once(clip)
            ev[k + 1].record()
        torch.cuda.synchronize()
        return [ev[k].elapsed_time(ev[k + 1]) for k in range(n)]

    for clip in arms.values():
        timed(clip, 3)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(10):
        with torch.no_grad():
            hk.fused_linear.token_logprobs_nograd(hidden, weight, labels, validate=False)
    ev1.record()
    torch.cuda.synchronize()
    out = {name: [] for name in arms}
    for r in range(4):
        for name, clip in (arms.items() if r % 2 == 0 else reversed(list(arms.items()))):
            out[name] += timed(clip)
        print(json.dumps({"round": r, **{k: round(statistics.median(v[-10:]), 3) for k, v in out.items()}}), flush=True)
    res = {k: round(statistics.median(v), 3) for k, v in out.items()}
    res["ratio"] = round(res["clip=HumanlineClip()"] / res["clip=None"], 4)
    res["token_logprobs_nograd_ms"] = round(ev0.elapsed_time(ev1) / 10, 3)
    res["device"] = torch.cuda.get_device_name()
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

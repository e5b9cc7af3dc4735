"""Humanline DPO in a plain loop without a reference model: ``hk.LookaheadReference``.

Same training as examples/plain_loop.py (a reference model synced every ``--sync-every`` steps), but the policy
computes the reference log-probs itself, at each sync step between its backward and ``optimizer.step()``, for the
batches of the next ``--sync-every`` steps (offline data: they are known in advance). No second model in memory,
nothing copied. Per optimizer step:

    for batch, ref_logps in lookahead:  policy forward + loss + backward  ->  lookahead.wait()  ->  optimizer.step()

CPU smoke run:  python examples/lookahead_loop.py --steps 5
See docs/lookahead.md for why it is exact and when it applies.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402
from humanline_dpo import DATA, write_toy_preferences  # noqa: E402
from plain_loop import encode, hidden_states, make_parser  # noqa: E402

import humanline_kernels as hk  # noqa: E402


def main(argv=None):
    p = make_parser(__doc__)
    a = p.parse_args(argv)
    if a.steps < 1 or a.pairs < 1 or a.sync_every < 1:
        p.error("--steps, --pairs and --sync-every must be positive")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy, tok = tiny.load(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    policy.to(device).train()
    rows = [json.loads(line) for line in open(a.data or (DATA if os.path.exists(DATA) else write_toy_preferences()))]

    def batches():  # offline data: every step's batch is known ahead
        for step in range(a.steps):
            yield encode(tok, [rows[(step * a.pairs + i) % len(rows)] for i in range(a.pairs)], device)

    def logps_fn(model, batch):  # called under no_grad, in eval mode, by the lookahead
        ids, attn, labels = batch
        return hk.fused_linear.token_logprobs(hidden_states(model, ids, attn), model.get_output_embeddings().weight,
                                              labels[:, 1:])

    lookahead = hk.LookaheadReference(policy, batches(), logps_fn, every=a.sync_every)
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr)
    clip = hk.HumanlineClip(a.log_eps_p, a.log_eps_r)
    history = []
    for step, ((ids, attn, labels), ref_logps) in enumerate(lookahead):
        loss, metrics = hk.fused_linear.dpo(hidden_states(policy, ids, attn), policy.get_output_embeddings().weight,
                                            labels[:, 1:], ref_logps, clip=clip, beta=a.beta)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        synced = lookahead.wait()  # sync step: the next window's reference log-probs, from this pre-update policy
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({"step": step, "loss": loss.item(), "synced": synced,
                        **{k: v.item() for k, v in metrics.items()}})
        print(json.dumps(history[-1]))
    return history


if __name__ == "__main__":
    main()

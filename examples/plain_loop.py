"""Humanline DPO in a plain PyTorch loop: the fused loss and ``hk.ReferenceSyncer`` used directly.

This is the pattern for custom loops (HALOs-style trainers, research code). Per optimizer step:

    reference forward (no grad)  ->  syncer.start()  ->  policy forward + fused loss + backward
    ->  clip grads  ->  syncer.wait()  ->  optimizer.step()

so the reference used in step t+1 holds θ_t, the policy before step t's update (synced every ``--sync-every``
steps). CPU smoke run:  python examples/plain_loop.py --steps 5
GPU, real model:        python examples/plain_loop.py --model Qwen/Qwen2.5-0.5B-Instruct --bf16 --steps 200
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402
from humanline_dpo import DATA, write_toy_preferences  # noqa: E402

import humanline_kernels as hk  # noqa: E402


def encode(tok, rows, device):
    """``input_ids [2P, L]`` (chosen rows first, then their rejected partners) and ``labels`` (-100 on prompt/pad)."""
    seqs = []
    for key in ("chosen", "rejected"):
        for r in rows:
            p = tok(r["prompt"], add_special_tokens=False).input_ids
            c = tok(r[key], add_special_tokens=False).input_ids + [tok.eos_token_id]
            seqs.append((p + c, [-100] * len(p) + c))
    L = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(lab)] = torch.tensor(s), torch.tensor(lab)
    return ids.to(device), (ids != tok.pad_token_id).long().to(device), labels.to(device)


def hidden_states(model, ids, attn):
    """Last hidden states at the positions that predict a next token (the shift: drop the last position)."""
    return model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]


def make_parser(description):
    """The flags of the plain-loop examples (this one and lookahead_loop.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--data", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=4, help="preference pairs per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--log-eps-p", type=float, default=-1.5)
    p.add_argument("--log-eps-r", type=float, default=1.5)
    p.add_argument("--bf16", action="store_true")
    return p


def main(argv=None):
    a = make_parser(__doc__).parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy, tok = tiny.load(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    policy.to(device).train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    rows = [json.loads(line) for line in open(a.data or (DATA if os.path.exists(DATA) else write_toy_preferences()))]
    opt = torch.optim.AdamW(policy.parameters(), lr=a.lr)
    syncer = hk.ReferenceSyncer(policy, reference, every=a.sync_every)
    clip = hk.HumanlineClip(a.log_eps_p, a.log_eps_r)
    history = []
    for step in range(a.steps):
        batch = [rows[(step * a.pairs + i) % len(rows)] for i in range(a.pairs)]
        ids, attn, labels = encode(tok, batch, device)
        targets = labels[:, 1:]
        with torch.no_grad():  # reference per-token log-probs, fused (no [N, V] logits kept)
            ref_logps = hk.fused_linear.token_logprobs(hidden_states(reference, ids, attn),
                                                       reference.get_output_embeddings().weight, targets)
        syncer.start()  # last reference forward of the step is done: the copy may overlap the policy's pass
        loss, metrics = hk.fused_linear.dpo(hidden_states(policy, ids, attn), policy.get_output_embeddings().weight,
                                            targets, ref_logps, clip=clip, beta=a.beta)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        synced = syncer.wait()  # before the update: the reference now holds this step's pre-update policy
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({"step": step, "loss": loss.item(), "synced": synced,
                        **{k: v.item() for k, v in metrics.items()}})
        print(json.dumps(history[-1]))
    return history


if __name__ == "__main__":
    main()

"""Humanline GRPO with TRL and rule-based rewards (toy arithmetic: reward 1 when the completion starts with the
right sum, a small bonus for stopping early, and a small shaping reward for digits).

CPU smoke run (tiny random-init model):
    python examples/humanline_grpo.py --max-steps 3
Off-policy, as the paper runs GRPO: sample N times the data every N steps (``--generate-every N``: TRL's
``steps_per_generation = N * gradient_accumulation_steps``, each completion used once), sync the reference every
k steps (the paper: k in [12, 24]; k = 1 collapses in math), and no reference model with the lookahead:
    python examples/humanline_grpo.py --generate-every 4 --sync-every 3 --reference lookahead --max-steps 8
The paper's math setting (arXiv 2509.24207: Qwen2.5-1.5B-Instruct in Open-R1, i.e. TRL's GRPOTrainer, 64 times the
data every 64 steps, humanline with k in [12, 24] matches online GRPO on MATH500), with this script's toy task in
place of Open-R1's MATH data and accuracy reward:
    python examples/humanline_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --bf16 --generate-every 64 \
        --sync-every 12 --max-steps 640 --num-generations 8 --batch-size 16 --max-completion-length 1024
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402


def arithmetic_dataset(n=64):
    from datasets import Dataset

    rows = [{"prompt": f"{i % 9}+{(5 * i) % 7}=", "answer": str(i % 9 + (5 * i) % 7)} for i in range(n)]
    return Dataset.from_list(rows)


def correctness_reward(completions, answer, **kwargs):
    """1.0 if the completion starts with the right number, 0.1 if it is short, else 0."""
    out = []
    for c, ans in zip(completions, answer):
        m = re.match(r"\s*(-?\d+)", c)
        out.append(1.0 if m and m.group(1) == ans else (0.1 if len(c.strip()) <= 3 else 0.0))
    return out


def digits_reward(completions, **kwargs):
    """Shaping: 0.2 x the fraction of the completion's characters that are digits (an answer is a number). Gives
    an untrained model a reward that differs between the completions of a group, hence a non-zero advantage and
    gradient from the first step (the correctness reward alone is 0 for every completion of a random model)."""
    return [0.2 * sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random-init, CPU) or a hub id / local path")
    p.add_argument("--output-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=2)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--log-eps-p", type=float, default=-1.5)
    p.add_argument("--log-eps-r", type=float, default=1.5)
    p.add_argument("--fused", default="linear", choices=["linear", "logits", "off"])
    p.add_argument("--generate-every", type=int, default=1,
                   help="sample N times the data every N optimizer steps (off-policy GRPO; 1: every step)")
    p.add_argument("--reference", default="sync", choices=["sync", "lookahead"],
                   help="'lookahead' (with --generate-every >= 2): no reference model")
    p.add_argument("--loss-type", default="dapo", help="any of TRL 1.16's GRPO loss types")
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args(argv)

    import torch

    from humanline_kernels.integrations.trl import HumanlineGRPOConfig, HumanlineGRPOTrainer

    tiny.quiet_trl_deprecations()
    model, tok = tiny.load(a.model, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    args = HumanlineGRPOConfig(
        output_dir=tiny.output_dir(a.output_dir, "humanline-grpo"), max_steps=a.max_steps,
        per_device_train_batch_size=a.batch_size,
        num_generations=a.num_generations, max_completion_length=a.max_completion_length, learning_rate=a.lr,
        beta=a.beta, logging_steps=1, save_strategy="no", report_to=[], bf16=a.bf16,
        use_cpu=not torch.cuda.is_available(),
        humanline=True, sync_every=a.sync_every, log_eps_p=a.log_eps_p, log_eps_r=a.log_eps_r, fused=a.fused,
        steps_per_generation=a.generate_every, humanline_reference=a.reference, loss_type=a.loss_type,
    )
    # With humanline_reference="sync" the trainer builds the reference (a copy of the policy) even when beta == 0.
    trainer = HumanlineGRPOTrainer(model, reward_funcs=[correctness_reward, digits_reward], args=args,
                                   train_dataset=arithmetic_dataset(), processing_class=tok)
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    print(json.dumps({k: last[k] for k in ("loss", "reward", "grad_norm", "humanline/unclipped_frac") if k in last}))
    return trainer


if __name__ == "__main__":
    main()

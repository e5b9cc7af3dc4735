"""Humanline DPO with LoRA (PEFT) through TRL: the reference is a frozen second adapter on the same base model.

The trainer adds a frozen ``ref`` adapter (a copy of the trained one), computes the reference log-probs under it
and, before each sync step's update, copies the trained adapter into it: megabytes instead of a second model.
Same flags as examples/humanline_dpo.py, plus the LoRA ones.

CPU smoke run:  python examples/humanline_lora_dpo.py --max-steps 5
A real model:   python examples/humanline_lora_dpo.py --model Qwen/Qwen2.5-0.5B-Instruct --bf16 --max-steps 500
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from humanline_dpo import make_parser, train  # noqa: E402


def main(argv=None):
    p = make_parser(__doc__)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--target-modules", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    a = p.parse_args(argv)
    if a.lora_r < 1 or a.max_steps < 1 or a.sync_every < 1:
        p.error("--lora-r, --max-steps and --sync-every must be positive")
    from peft import LoraConfig

    trainer = train(a, LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, target_modules=a.target_modules,
                                  lora_dropout=0.0))
    params = dict(trainer.model.named_parameters())
    per_sync = sum(p.numel() * p.element_size() for n, p in params.items() if ".ref." in n)
    full = sum(p.numel() * p.element_size() for n, p in params.items() if ".ref." not in n)
    print(json.dumps({"bytes_copied_per_sync": per_sync, "full_model_sync_bytes": full,
                      "syncs": trainer.hk_sync.num_syncs}))
    return trainer, per_sync, full


if __name__ == "__main__":
    main()

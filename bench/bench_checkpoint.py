"""What resuming exactly costs: the size and the time of a humanline DPO trainer's checkpoint with the reference's
weights (``save_reference=True``, the default), with the schedule only (``save_reference=False``) and a stock
(humanline=False) checkpoint, on a random-init Llama of a chosen size (CPU or the GPU of the machine).

    python -m bench checkpoint [--hidden 512] [--layers 8] [--vocab 32000] [--repeat 3] [--out bench/out]
    python -m bench checkpoint --checksums [...]

Prints a table (checkpoint MiB, the humanline files' MiB, the whole save's seconds and the humanline part's) and
writes ``checkpoint.json`` (with the machine, versions and shapes) and ``checkpoint.png`` into ``--out``.

``--checksums`` times what the tensors' checksums cost instead (docs/sync.md, "Integrity"): the humanline state of a
``ReferenceSyncer`` between the same Llama as policy (fp32) and reference (fp32, then bf16), saved and loaded with
``hk.save_humanline_state`` / ``hk.load_humanline_state``, and the CRC-32 part of each (``checkpoint_checksums.json``).
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import time

from .cli import Parser


def _args(argv):
    p = Parser(prog="python -m bench checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeat", type=int, default=3, help="saves timed per arm (the median is reported)")
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output directory (default bench/out)")
    p.add_argument("--checksums", action="store_true",
                   help="time the checksums' share of saving and loading the humanline state instead")
    a = p.parse_args(argv)
    for name in ("hidden", "layers", "vocab", "repeat"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be a positive int")
    if a.hidden % 8:
        p.error("--hidden must be a multiple of 8 (8 attention heads)")
    return a


def _size(folder, prefix=""):
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.startswith(prefix) and os.path.isfile(os.path.join(folder, f)))


def run(a):
    work = tempfile.mkdtemp(prefix="hk-ckpt-")
    try:
        return _run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gigabytes of checkpoints at real sizes


def _llama(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _meta(a, params):
    import torch
    return {"params": params, "shape": {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()}, "
            f"{os.cpu_count()} cores)", "torch": torch.__version__, "repeat": a.repeat}


def _run(a, work):
    return (_checksums if a.checksums else _trainer_arms)(a, work)


def _checksums(a, work):
    """Save and load of the humanline state, and the CRC-32 part of each (the calls of ``_state._checksum``, timed
    where they run), for an fp32 and a bf16 reference."""
    import copy
    import statistics

    import torch

    import humanline_kernels as hk
    from humanline_kernels.sync import _state

    policy = _llama(a)
    crc = []
    real = _state._checksum

    def timed(t):
        start = time.perf_counter()
        out = real(t)
        crc.append(time.perf_counter() - start)
        return out
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        reference = copy.deepcopy(policy).to(dtype)
        syncer = hk.ReferenceSyncer(policy, reference, overlap=False)
        folder = os.path.join(work, str(dtype))
        times = {"save": [], "save_crc": [], "load": [], "load_crc": []}
        _state._checksum = timed
        try:
            for _ in range(a.repeat):
                for what, call in (("save", lambda: hk.save_humanline_state(folder, syncer=syncer)),
                                   ("load", lambda: hk.load_humanline_state(folder, syncer=syncer))):
                    crc.clear()
                    start = time.perf_counter()
                    call()
                    times[what].append(time.perf_counter() - start)
                    times[f"{what}_crc"].append(sum(crc))
        finally:
            _state._checksum = real
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"reference": str(dtype).removeprefix("torch."),
                     "file_mib": _size(folder, "humanline_reference") / 2**20,
                     "save_s": med["save"], "save_crc_s": med["save_crc"], "load_s": med["load"],
                     "load_crc_s": med["load_crc"], "crc_gib_per_s": _size(folder, "humanline_reference") / 2**30
                     / med["load_crc"]})
    return _meta(a, sum(p.numel() for p in policy.parameters())), rows


def _trainer_arms(a, work):
    import statistics

    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from humanline_kernels.integrations.trl import HumanlineDPOConfig, HumanlineDPOTrainer

    model = _llama(a)
    params = sum(p.numel() for p in model.parameters())
    path = os.path.join(work, "model")
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, **{chr(97 + i): 2 + i for i in range(26)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                                  pad_token="<pad>", eos_token="<eos>")
    tok.pre_tokenizer = None
    data = Dataset.from_list([{"prompt": "ab", "chosen": "cd", "rejected": "ef"}] * 4)
    arms = {"humanline": dict(humanline=True), "save_reference=False": dict(humanline=True, save_reference=False),
            "stock (humanline=False)": dict(humanline=False)}
    rows = []
    for i, (arm, kw) in enumerate(arms.items(), 1):
        print(f"[{i}/{len(arms)}] {arm}: one step, then {a.repeat} timed checkpoints", file=sys.stderr, flush=True)
        out = os.path.join(work, f"run{i}")
        args = HumanlineDPOConfig(output_dir=out, per_device_train_batch_size=2, max_steps=1, report_to=[],
                                  save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                  use_cpu=not torch.cuda.is_available(), fused="logits", **kw)
        trainer = HumanlineDPOTrainer(path, args=args, train_dataset=data, processing_class=tok)
        trainer.train()
        total, ours = [], []
        real = trainer._hk_save_state

        def timed(folder):
            t = time.perf_counter()
            real(folder)
            ours.append(time.perf_counter() - t)
        trainer._hk_save_state = timed
        for _ in range(a.repeat):
            t = time.perf_counter()
            trainer._save_checkpoint(trainer.model, None)
            total.append(time.perf_counter() - t)
        folder = os.path.join(out, "checkpoint-1")
        rows.append({"arm": arm, "checkpoint_mib": _size(folder) / 2**20,
                     "humanline_mib": _size(folder, "humanline") / 2**20,
                     "save_s": statistics.median(total), "humanline_s": statistics.median(ours or [0.0])})
    return _meta(a, params), rows


def main(argv=None):
    from bench import common
    a = _args(argv)
    meta, rows = run(a)
    if a.checksums:
        print(f"{meta['params'] / 1e6:.1f} M params (fp32 policy; the reference's dtype per row), {meta['device']}, "
              f"torch {meta['torch']}; medians of {a.repeat} saves and loads")
        common.save("checkpoint_checksums", rows, meta, a.out, series="reference", bar=("save_s", "load_s"))
        return 0
    print(f"{meta['params'] / 1e6:.1f} M params (fp32 policy and reference, AdamW), {meta['device']}, torch "
          f"{meta['torch']}; medians of {a.repeat} saves")
    common.save("checkpoint", rows, meta, a.out, series="arm", bar=("checkpoint_mib", "save_s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

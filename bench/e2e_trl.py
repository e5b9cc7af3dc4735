"""The TRL-level arms of ``python -m bench e2e``: stock ``trl.DPOTrainer`` against ``HumanlineDPOTrainer``.

* ``trl_dpo``: ``trl.DPOTrainer`` as most users run it: a frozen bf16 reference model whose forward runs every
  step (TRL's default, ``precompute_ref_log_probs=False``), TRL's own fused log-prob head, no humanline;
* ``trl_sync``: ``HumanlineDPOTrainer`` (``fused="linear"``, ``sync_every=1``): the same reference model, synced
  from the policy before every update, clip on;
* ``trl_lookahead``: ``HumanlineDPOTrainer(humanline_reference="lookahead")``: no reference model;
* ``trl_dpo_compile``, ``trl_sync_compile``: ``trl_dpo`` and ``trl_sync`` with ``torch_compile=True`` (backend
  ``--compile-backend``) and ``gradient_checkpointing=False`` in both: TRL 1.16 toggles checkpointing around its
  reference forward, and each toggle leaves transformers 5 one more input-embedding hook, on which the compiled
  forward's guards fail: the stock arm would recompile every step.

Every arm trains the model of ``bench e2e`` (same seed, so the same initial weights) on the same data: the batches
of the plain arms written as text over a word-level tokenizer of the model's vocabulary, so that TRL's collator
gives back the same token ids (chosen rows, then their rejected partners, one shared prompt), in order
(``train_sampling_strategy="sequential"``: step i sees batch i % 4), ``per_device_train_batch_size`` = the plain
arms' pairs, no gradient accumulation, and the same optimizer (``torch.optim.AdamW(fused=True)`` at a constant
learning rate, passed to the trainer; no gradient clipping). A step is timed inside the trainer's own loop: a
callback records a CUDA event (``perf_counter`` on CPU) at the end of every optimizer step, so a step's time is
everything the loop does between two of them (data, forwards, backward, sync, optimizer, TRL's metrics). Peak
memory is reset and the held bytes are counted at the end of the warm-up, as for the plain arms.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

PAD, EOS, UNK = 0, 1, 2
FIRST_ID = 3  # token ids below it are the tokenizer's specials; the batches draw theirs from [FIRST_ID, V)


def tokenizer(vocab):
    """A word-level tokenizer whose word ``t{k}`` is token ``k`` (``<pad>``, ``<eos>``, ``<unk>`` are 0, 1, 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK, **{f"t{k}": k for k in range(FIRST_ID, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def dataset(batches, n_steps, prompt_len):
    """TRL preference rows for ``n_steps`` optimizer steps, step i from ``batches[i % len(batches)]``: pair j's
    prompt is row j's first ``prompt_len`` tokens, its chosen and rejected completions rows j and P + j after it
    (their last token is the end of sequence, which TRL would append)."""
    from datasets import Dataset

    def words(ids):
        return " ".join(f"t{k}" for k in ids)
    rows = []
    for i in range(n_steps):
        ids = batches[i % len(batches)][0].cpu()
        pairs = ids.shape[0] // 2
        for j in range(pairs):
            assert ids[j, -1] == EOS and ids[pairs + j, -1] == EOS
            rows.append({"prompt": words(ids[j, :prompt_len].tolist()),
                         "chosen": " " + words(ids[j, prompt_len:-1].tolist()) + "<eos>",
                         "rejected": " " + words(ids[pairs + j, prompt_len:-1].tolist()) + "<eos>"})
    return Dataset.from_list(rows)


def _clock(warmup, cuda, held_fn):
    """A ``TrainerCallback`` that marks the end of every optimizer step and, at the end of the warm-up, resets the
    peak memory statistics and counts the bytes held (``held_fn(trainer)``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.held, self.trainer = [], None, None

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self.marks.append(ev)
            else:
                self.marks.append(time.perf_counter())
            if state.global_step == warmup:
                self.held = held_fn(self.trainer)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()

        def step_ms(self):
            if cuda:
                torch.cuda.synchronize()
                return [a.elapsed_time(b) for a, b in zip(self.marks[warmup - 1:], self.marks[warmup:])]
            return [(b - a) * 1e3 for a, b in zip(self.marks[warmup - 1:], self.marks[warmup:])]
    return StepClock()


def _quiet():
    """The trainers' chatter off: datasets' progress bars, transformers' notices, the FutureWarnings that TRL 1.16's
    own code raises under transformers 5.2x (old checkpointing names)."""
    import warnings

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"`\w+` is deprecated and will be removed", category=FutureWarning)


def run_arm(arm, a, device, dtype, *, policy, frozen_copy, adamw, batches, tensor_bytes):
    """Warm-up and timed steps of one TRL arm inside ``Trainer.train``: every step's loss, median ms, peak and held
    GiB (the same keys as the plain arms)."""
    _quiet()
    cuda = device == "cuda"
    model = policy(a, device, dtype)
    n_steps = a.warmup + a.steps
    data = dataset(batches, n_steps, a.seq // 2)
    with tempfile.TemporaryDirectory(prefix="hk-e2e-trl-") as out:
        return _train(arm, a, cuda, model, data, out, frozen_copy, adamw, device, tensor_bytes)


def _train(arm, a, cuda, model, data, out, frozen_copy, adamw, device, tensor_bytes):
    from transformers import PrinterCallback, get_constant_schedule
    from trl import DPOConfig, DPOTrainer

    from humanline_kernels.integrations.trl import HumanlineDPOConfig, HumanlineDPOTrainer

    n_steps = a.warmup + a.steps
    common = dict(output_dir=out, per_device_train_batch_size=a.batch // 2, gradient_accumulation_steps=1,
                  max_steps=n_steps, train_sampling_strategy="sequential", max_length=None, max_grad_norm=0.0,
                  logging_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                  use_cpu=not cuda, bf16=False, dataloader_num_workers=0, beta=0.1)
    if arm.endswith("_compile"):
        common.update(torch_compile=True, torch_compile_backend=a.compile_backend, gradient_checkpointing=False)
    if arm.startswith("trl_dpo"):
        args, cls = DPOConfig(**common), DPOTrainer
    else:
        args = HumanlineDPOConfig(**common, humanline=True, sync_every=1, fused="linear",
                                  humanline_reference="lookahead" if arm == "trl_lookahead" else "sync")
        cls = HumanlineDPOTrainer
    ref = None if arm == "trl_lookahead" else frozen_copy(model)
    opt = adamw(model, a.lr, device)

    def held(trainer):
        tensors = list(trainer.model.parameters()) + list(trainer.model.buffers())
        if getattr(trainer, "ref_model", None) is not None:
            tensors += list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())
        tensors += [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return tensor_bytes(tensors) / 2**30

    clock = _clock(a.warmup, cuda, held)
    trainer = cls(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer(a.vocab),
                  optimizers=(opt, get_constant_schedule(opt)), callbacks=[clock])
    clock.trainer = trainer
    trainer.remove_callback(PrinterCallback)  # (it prints the final metrics dict; the CLI prints its own table)
    losses = []
    step = trainer.training_step

    def training_step(*args, **kwargs):  # the loop's own loss of each step (detached, read after training)
        loss = step(*args, **kwargs)
        losses.append(loss.detach())
        return loss
    trainer.training_step = training_step
    trainer.train()
    times = clock.step_ms()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"ms": statistics.median(times), "peak_GiB": peak, "held_GiB": clock.held,
            "losses": [float(x) for x in losses]}

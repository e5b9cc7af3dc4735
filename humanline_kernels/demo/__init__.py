"""Humanline in miniature: offline vs offline+humanline vs online DPO / KTO / GRPO on a tiny Llama, tuned fairly.

``python -m humanline_kernels.demo [--objective dpo|kto|grpo|all] [--steps N] [--seeds S] [--lrs a,b,c] ...``

The paper's experiment (arXiv 2509.24207, Sec. 5, App. D) in miniature, measured rather than asserted:

* the task (:mod:`.task`): tiny random-init Llamas learn a checkable rule (count up from the prompt's last symbol);
  the *behaviour* model (fitted to a noisy rule, whole completions right about half the time) writes the offline
  data, another (token-level noise, rarely right end to end) is the starting policy of every arm;
* the arms (:mod:`.arms`): ``offline``, ``offline+humanline`` (the reference synced by ``hk.ReferenceSyncer``,
  every log-ratio clamped) and ``online``, from the same policy with the same prompts and number of examples;
* fair tuning and statistics (:mod:`.stats`): every arm trains at every learning rate of one grid for every seed,
  is reported at the rate with the best mean on held-out prompts, on other prompts, as mean +- s.e. over seeds;
* the experiment (:mod:`.experiment`): the grid in worker processes, the table, a ``verdict:`` line and a plot;
* the record (:mod:`.record`, ``--save``) that README's demo table is written from by ``python -m bench report``,
  with a canary (:mod:`.canary`) that CI repeats, so that the record cannot silently stop describing the code;
* the command line (:mod:`.cli`).

On CUDA the losses run through the fused Triton kernels (``hk.fused``), on CPU through the eager path. Runs are
seeded: the same settings, torch version and CPU rounding give the same numbers. The rounding is the CPU's vector
instruction set as ATen and MKL use it (printed beside ``device=cpu``): training amplifies a last-bit difference
into different samples, so another instruction set gives other numbers.
"""
from .cli import main

__all__ = ["main"]

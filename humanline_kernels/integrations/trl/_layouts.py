"""What the trainers add to a batch on the CPU, where TRL's collator makes it: the supervised ranges of the
fused-linear head and, for DPO's ``padding_free``, the packed stream.

Both are host data that a device sync would otherwise have to read back: the ranges are Python lists (which
``Trainer._prepare_inputs`` and accelerate's loaders pass through as they are), the boundaries are a Python list
for the losses plus TRL's own varlen keys (``cu_seq_lens_q/k`` int32 tensors, ``max_length_q/k`` ints) for
flash-attn, as TRL's padding-free SFT collator makes them (``trl/trainer/sft_trainer.py``,
``DataCollatorForLanguageModeling``).

Coordinates: the head scores ``hidden[:, :-1]``, position ``t`` predicting token ``t + 1``; a row's range covers
the positions whose next token is a completion token (from its first to its last, so a range is never short).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def supervised_key(prefix=""):
    """The batch's key of the ranges of the ``prefix + "completion_mask"`` rows (KTO's KL rows: ``"KL_"``); like
    :data:`CU_SEQLENS`, ours and never a model input."""
    return f"hk_{prefix}supervised"


SUPERVISED = supervised_key()
CU_SEQLENS = "hk_cu_seqlens"


def completion_ranges(completion_mask: torch.Tensor) -> list:
    """Per row, the head's ``[start, end)`` covering every position that predicts a completion token (a CPU mask
    ``[B, L]``; the first token of a row is never predicted)."""
    m = completion_mask.bool()
    L = m.size(1)
    first = m.int().argmax(1)
    last = L - 1 - m.flip(1).int().argmax(1)
    start = torch.where(m.any(1), (first - 1).clamp(min=0), 0)
    end = torch.where(m.any(1), last, 0)
    return torch.stack([start, torch.maximum(start, end)], 1).tolist()


def pack(batch: dict, pad_token_id: int, pad_to_multiple_of=None) -> dict:
    """A right-padded CPU batch ``[B, L]`` as one padding-free row ``[1, N]``: the rows end to end in their order,
    ``position_ids`` restarting at 0, no attention mask, TRL's varlen keys and :data:`CU_SEQLENS`. Every other
    ``[B, L]`` tensor is packed alike; the rest passes. ``pad_to_multiple_of`` pads the stream (not each row) and
    the padding joins the last sequence, as its continuation (causal attention: no real token sees it)."""
    am = batch.get("attention_mask")
    if not torch.is_tensor(am) or am.dim() != 2:
        raise ValueError("padding_free=True packs the collator's right-padded rows by their attention_mask [B, L], "
                         "which this batch lacks (a collator that packs already?)")
    B, L = am.shape
    lengths = am.sum(1)
    if not torch.equal(am.bool(), torch.arange(L) < lengths[:, None]):
        raise ValueError("padding_free=True packs right-padded rows; this collator's attention_mask is not a prefix "
                         "of ones in every row")
    keep = am.bool()
    lens = lengths.tolist()
    N = sum(lens)
    pad = (-N) % pad_to_multiple_of if pad_to_multiple_of else 0
    out = {}
    for k, v in batch.items():
        if k == "attention_mask":
            continue
        if torch.is_tensor(v) and v.dim() >= 2 and tuple(v.shape[:2]) == (B, L):
            v = v[keep][None]
            if pad:
                v = F.pad(v.transpose(1, -1), (0, pad), value=pad_token_id if k == "input_ids" else 0).transpose(1, -1)
        out[k] = v
    if pad:
        lens = lens[:-1] + [lens[-1] + pad]
    cu = list(itertools.accumulate(lens, initial=0))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out["position_ids"] = torch.cat([torch.arange(n) for n in lens])[None]
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu_t
    out["max_length_q"] = out["max_length_k"] = max(lens, default=0)
    # each token's sequence, for the short convolutions of linear-attention layers (TRL's SFT collator passes it)
    out["seq_idx"] = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), cu_t.diff())[None]
    out[CU_SEQLENS] = cu
    return out


class LayoutCollator:
    """``collator``'s batch plus, on the CPU, the supervised ranges (``ranges``: one key per completion mask,
    ``prefixes`` "" and KTO's "KL_") and, with ``packed``, the batch packed (:func:`pack`)."""

    def __init__(self, collator, *, ranges=True, prefixes=("",), packed=False, pad_token_id=0, pad_to_multiple_of=None):
        self.collator, self.ranges, self.prefixes, self.packed = collator, ranges, prefixes, packed
        self.pad_token_id, self.pad_to_multiple_of = pad_token_id, pad_to_multiple_of

    def __call__(self, examples):
        batch = self.collator(examples)
        for prefix in self.prefixes if self.ranges else ():
            cm = batch.get(prefix + "completion_mask")
            if torch.is_tensor(cm) and cm.device.type == "cpu":  # (a collator on the device: dense, no sync)
                batch[supervised_key(prefix)] = completion_ranges(cm)
        if self.packed:
            batch = pack(batch, self.pad_token_id, self.pad_to_multiple_of)
        return batch


def last_positions(x, T):
    """A head's per-token output ``[R, >= T - 1]`` on the mask's ``T`` positions: padded rows keep their last ``T``
    (prompt-learning PEFT prepends virtual tokens), a packed stream ``[1, N - 1]`` gets a 0 for its last position,
    which predicts nothing, so that it lines up with the stream's ``[1, N]`` and its boundaries."""
    if x is None:
        return None
    x = x[:, -T:]
    return x if x.size(1) == T else F.pad(x, (0, T - x.size(1)))

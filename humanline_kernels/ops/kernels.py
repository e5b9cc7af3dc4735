"""Every launcher of the kernels, under the names its eager twin (:mod:`humanline_kernels._eager`) shares: the
autograd functions above choose one of the two once, per call (:func:`humanline_kernels.ops.use_kernels`), and call
the same names on it. Importing this module imports Triton."""
from __future__ import annotations

from .cluster import DEVICES as CLUSTER_DEVICES
from .cluster import grpo_cluster
from .dpo import dpo_finalize, dpo_loss
from .grpo import grpo_finalize, grpo_loss
from .kto import kto_finalize, kto_loss
from .logprobs import logprobs_bwd, logprobs_fwd, scale_rows_, scaled
from .sequence import seq_finalize
from .token_terms import token_terms
from .tuning import grad_in_forward_entry

__all__ = ["logprobs_fwd", "logprobs_bwd", "scale_rows_", "scaled", "token_terms", "FINALIZE", "ONE_LAUNCH",
           "dpo_finalize", "kto_finalize", "grpo_finalize", "seq_finalize", "dpo_loss", "kto_loss", "grpo_loss",
           "grpo_cluster", "CLUSTER_DEVICES", "grad_in_forward_entry"]

# a loss's [B, T] tail after the row kernel (a packed batch, a fused-linear chunk), by the loss's name
FINALIZE = {"dpo": dpo_finalize, "kto": kto_finalize, "grpo": grpo_finalize}
# a dense batch's forward in one launch, the tail folded into the row kernel
ONE_LAUNCH = {"dpo": dpo_loss, "kto": kto_loss, "grpo": grpo_loss}

"""The model's MTP head as the model runner runs it (speculative ``method="mtp"``).

The head's attention layer is one more layer of the target's paged KV cache: the model runner allocates it with
the others, and the head's keys and values of position ``p`` sit in the slot the target's block table gives
``p``. So the head follows the target's blocks, their release after a rejected proposal and preemption, with no
bookkeeping of its own. The head always attends through the PyTorch reference backend (on CUDA too: its steps
are small and its metadata is the reference step's), and its hidden states come from the target's last forward
(``mtp_target_hidden``, every row: Qwen3.5's after the final norm, DeepSeek-V4's hyper-connection streams before
its hyper-head). The head's own layer keeps no state slots (DeepSeek-V4's MTP layer is a sliding one).
"""

from __future__ import annotations

import torch

from pocketllm.layers.attention import Attention
from pocketllm.layers.attention_backend import TorchAttentionBackend
from pocketllm.runner.step_backend import ReferenceStep
from pocketllm.step.host_batch import HostBatch


class MtpHead:
    """Runs ``model.mtp`` over host batches whose rows are (position, the token after it, a hidden state)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int) -> None:
        self.model = model
        # Only the tensors of a host batch are taken from it (no state slots: the head has no recurrent layer).
        self.reference = ReferenceStep(model, device, block_size, None, False)
        self.attention_layers = [m for m in model.mtp.modules() if isinstance(m, Attention)]
        self.use_reference_attention()

    def use_reference_attention(self) -> None:
        """Bind the head's attention to the PyTorch reference backend (after the runner bound the kernels')."""
        for layer in self.attention_layers:
            layer.backend = TorchAttentionBackend()

    def target_hidden(self) -> torch.Tensor:
        """The target's hidden states (as the model keeps them for its head) of every row of its last forward."""
        hidden = self.model.mtp_target_hidden
        if hidden is None:
            raise RuntimeError("the MTP head needs the target's hidden states, but no forward kept them")
        return hidden

    def release_target_hidden(self) -> None:
        self.model.mtp_target_hidden = None

    @torch.inference_mode()
    def forward(self, host: HostBatch, hidden: torch.Tensor,
                previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The head's hidden states of every row of ``host`` (Qwen3.5: after its norm [rows, H]; DeepSeek-V4: its
        output streams [rows, hc, H]): ``host.input_ids`` are the tokens after ``host.positions``, ``hidden`` the
        hidden states at those positions; ``host.pending`` inputs are taken from ``previous_tokens`` (on the
        device)."""
        ids, positions, meta = self.reference.tensors(host, previous_tokens)
        return self.model.mtp_forward(ids, positions, hidden, meta)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of the head's hidden states (through the model's ``mtp_logits`` where it has one:
        DeepSeek-V4's MTP layer collapses its streams first)."""
        return getattr(self.model, "mtp_logits", self.model.compute_logits)(hidden)

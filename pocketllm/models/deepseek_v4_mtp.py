"""DeepSeek-V4's multi-token-prediction layer (``mtp.0.*`` in DeepSeek's checkpoint names), for speculative
``method="mtp"``.

At position ``p`` it takes the embedding of token ``p + 1`` and the target's hyper-connection streams at ``p``
(the last decoder layer's output [hc, D], before the target's hyper-head and final norm): ``enorm`` normalises
the embedding, ``hnorm`` each stream; ``e_proj`` of the embedding is added to ``h_proj`` of every stream, and one
decoder block of the model's own kind (hyper-connected attention and routed experts) runs over the streams. Its
own hyper-head (``hc_head``) and final ``norm`` collapse the output streams for the target's LM head; the
embedding table is the target's. A chained proposal takes the layer's own output streams as its hidden state.

transformers' config keeps ``layer_types`` and ``mlp_layer_types`` for the main layers only, so the layer's kind
is fixed here: sliding-window attention without a compressor (its keys one more layer of the paged KV cache,
addressed by position, so a rejected proposal's keys go back with the target's blocks), and score-routed
experts (hashed routing covers only the first layers). A checkpoint whose MTP layer carries compressor weights
or a hash-routing table is refused by name as it loads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.linear import ReplicatedLinear
from pocketllm.models.deepseek_v4_attention import SLIDING, Fp32RMSNorm, InterleavedRotary
from pocketllm.models.deepseek_v4_blocks import MOE, DeepseekV4DecoderLayer, HyperHead
from pocketllm.step.attention_metadata import AttentionMetadata


class DeepseekV4MtpLayer(DeepseekV4DecoderLayer):
    """The MTP block: a sliding, score-routed decoder block plus the input norms and projections, and its own
    hyper-head and final norm."""

    def __init__(self, config: Any, rotary: dict[str, InterleavedRotary]) -> None:
        super().__init__(config, SLIDING, MOE, rotary)
        hidden = config.hidden_size
        self.enorm = Fp32RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = Fp32RMSNorm(hidden, config.rms_norm_eps)
        self.e_proj = ReplicatedLinear(hidden, hidden)
        self.h_proj = ReplicatedLinear(hidden, hidden)
        self.hc_head = HyperHead(config)
        self.norm = Fp32RMSNorm(hidden, config.rms_norm_eps)

    def predict(self, embedded: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The block's output streams [T, hc, D] of ``embedded`` [T, D] (the embeddings of ``input_ids``, the
        tokens after ``positions``) and ``streams`` [T, hc, D] (the hidden streams at ``positions``)."""
        normed = self.hnorm(streams)
        # (The projection on rows [T * hc, D]: a CPU weight format's linear layers take two dimensions.)
        projected = self.h_proj(normed.flatten(0, 1)).view_as(normed)
        mixed = self.e_proj(self.enorm(embedded)).unsqueeze(1) + projected
        return self(mixed, input_ids, positions, meta)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """What the LM head scores: the streams through the layer's hyper-head and final norm."""
        return self.norm(self.hc_head(streams))


class DeepseekV4MultiTokenPredictor(nn.Module):
    """``layers[0]``: the checkpoint's one MTP layer (``mtp.0.*`` loads as ``mtp.layers.0.*``)."""

    def __init__(self, config: Any, rotary: dict[str, InterleavedRotary]) -> None:
        super().__init__()
        count = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        if count != 1:
            what = "declares no MTP layer (num_nextn_predict_layers 0)" if count == 0 else f"declares {count}"
            raise UnsupportedFeatureError(f"speculative_config.method 'mtp' needs a checkpoint with one MTP layer; "
                                          f"this one {what}")
        self.layers = nn.ModuleList([DeepseekV4MtpLayer(config, rotary)])

    def forward(self, embedded: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.layers[0].predict(embedded, streams, input_ids, positions, meta)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        return self.layers[0].collapse(streams)

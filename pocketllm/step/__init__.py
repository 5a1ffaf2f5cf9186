"""The data one step carries from the engine to the runner and the layers: scheduled chunks, the host batch,
attention metadata, sampled tokens. It sits below ``layers/`` so every package above can share it."""

from pocketllm.step.attention_metadata import AttentionMetadata
from pocketllm.step.host_batch import HostBatch, gather_host_batch
from pocketllm.step.pending_inputs import PendingInputs
from pocketllm.step.sampled import SampledToken, SampleResult
from pocketllm.step.scheduled_chunk import ScheduledChunk

__all__ = ["AttentionMetadata", "HostBatch", "PendingInputs", "SampleResult", "SampledToken", "ScheduledChunk",
           "gather_host_batch"]

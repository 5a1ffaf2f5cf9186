"""What the front end asks of the engine thread: one small dataclass per kind of command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pocketllm.engine.kv_snapshot import KVSnapshot
from pocketllm.engine.request import Request
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken


class OutputSink(Protocol):
    """Receives a request's outputs on the engine thread; must not block."""

    def on_output(self, request: Request, token: SampledToken | None, last: bool = True) -> bool:
        """Handle one step's result (``token`` None: ended without a new token, e.g. cancelled); ``last``: no
        later token of this request follows in the step (a verify step emits several, in order).

        Return True to end the request now (the front end found a stop string).
        """
        ...

    def on_error(self, error: BaseException) -> None: ...


@dataclass(frozen=True)
class AddRequest:
    """Queue a request; its outputs go to ``sink``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: OutputSink


@dataclass(frozen=True)
class Abort:
    """Cancel an active request at this step boundary."""

    request_id: str


@dataclass(frozen=True)
class SetPrefillBudget:
    """Most prompt tokens one request prefills per step (0: each prompt whole in one step)."""

    tokens: int


@dataclass(frozen=True)
class ExportPrefix:
    """The ``KVSnapshot`` of the longest cached whole-block prefix of ``token_ids``, from ``first_token`` on."""

    token_ids: list[int]
    model_path: str
    first_token: int = 0


@dataclass(frozen=True)
class ImportPrefix:
    """Put a snapshot's blocks into the prefix cache; the result is the number of leading tokens it serves."""

    snapshot: KVSnapshot
    model_path: str


@dataclass(frozen=True)
class Shutdown:
    """Cancel every request and stop the engine thread."""


Command = AddRequest | Abort | SetPrefillBudget | ExportPrefix | ImportPrefix | Shutdown

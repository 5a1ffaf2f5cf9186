"""A chat stream's chunks retold as the Responses API's typed events, each with its ``sequence_number``.

The order is OpenAI's: ``response.created`` and ``response.in_progress``; per output item
``response.output_item.added``, its content (a message: ``response.content_part.added``, the
``response.output_text.delta`` events, ``response.output_text.done``, ``response.content_part.done``; a call:
``response.function_call_arguments.delta`` events, ``response.function_call_arguments.done``; reasoning: its
``response.reasoning_text`` events) and ``response.output_item.done``; then ``response.completed`` (or
``response.incomplete``, ``response.failed``) with the whole response. Calls arrive as the chat stream sends them:
only once they parse, as a header and argument fragments.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from pocketllm.protocol.responses_request import ResponsesRequest
from pocketllm.server import response_objects as objects


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event named by its type; always valid UTF-8."""
    data = json.dumps(event, ensure_ascii=False)
    try:
        data.encode("utf-8")
    except UnicodeEncodeError:
        data = json.dumps(event, ensure_ascii=True)
    return f"event: {event['type']}\ndata: {data}\n\n"


class ResponseEventWriter:
    """Turns the chunks of one chat stream (one choice) into Responses events."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str) -> None:
        self.request = request
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())   # whole seconds, as OpenAI's created_at
        self.sequence = 0
        self.output: list[dict[str, Any]] = []     # finished items, in order
        self.open: dict[str, Any] | None = None    # the item being streamed
        self.text = ""                             # its text (message, reasoning) or arguments (call)
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str) -> dict[str, Any]:
        _, incomplete = objects.status_of(self.finish_reason)
        return objects.response_body(self.response_id, self.created, self.model, self.request, status=status,
                                     output=list(self.output), usage_=objects.usage(self.usage),
                                     incomplete=incomplete if status == "incomplete" else None, error=self.error)

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    # --- items -----------------------------------------------------------------------------------
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.open, self.text = item, ""
        events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part=objects.output_text("")))
        elif item["type"] == "reasoning":
            events.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """The done events of the open item, which joins the output."""
        item = self.open
        if item is None:
            return []
        status = "incomplete" if self.finish_reason == "length" and item["type"] != "function_call" else "completed"
        where = self._where()
        events = []
        if item["type"] == "message":
            part = objects.output_text(self.text)
            events += [self._event("response.output_text.done", **where, content_index=0, text=self.text,
                                   logprobs=[]),
                       self._event("response.content_part.done", **where, content_index=0, part=part)]
            done = objects.message_item(item["id"], self.text, status)
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            events += [self._event("response.reasoning_text.done", **where, content_index=0, text=self.text),
                       self._event("response.content_part.done", **where, content_index=0, part=part)]
            done = objects.reasoning_item(item["id"], self.text, status)
        else:
            events.append(self._event("response.function_call_arguments.done", **where, arguments=self.text))
            done = {**item, "arguments": self.text, "status": "completed"}
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=done))
        self.output.append(done)
        self.open, self.text = None, ""
        return events

    def _is_open(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    # --- chunks ----------------------------------------------------------------------------------
    def chunk(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (an error object fails the response at the end)."""
        if "error" in chunk:
            self.error = {"code": "server_error", "message": str(chunk["error"].get("message", ""))}
            return [self._event("error", code="server_error", message=self.error["message"], param=None)]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if not self._is_open("reasoning"):
                    events += self._open(objects.reasoning_item(objects.item_id("rs"), "", "in_progress"))
                self.text += delta["reasoning_content"]
                events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                                          delta=delta["reasoning_content"]))
            if delta.get("content"):
                if not self._is_open("message"):
                    events += self._open(objects.message_item(objects.item_id("msg"), None, "in_progress"))
                self.text += delta["content"]
                events.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                          delta=delta["content"], logprobs=[]))
            for entry in delta.get("tool_calls") or []:
                if "id" in entry:   # a call's header: a new item
                    call = {"id": entry["id"], "function": {"name": entry["function"]["name"], "arguments": ""}}
                    events += self._open(objects.function_call_item(objects.item_id("fc"), call, "in_progress"))
                    continue
                fragment = entry["function"]["arguments"]
                self.text += fragment
                events.append(self._event("response.function_call_arguments.delta", **self._where(),
                                          delta=fragment))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                events += self._close()
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The last event: the whole response, completed, incomplete or failed."""
        events = self._close()
        if self.error is not None:
            status = "failed"
        else:
            status, _ = objects.status_of(self.finish_reason)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "failed": "response.failed"}.get(status, "response.failed")
        return [*events, self._event(kind, response=self._response(status))]

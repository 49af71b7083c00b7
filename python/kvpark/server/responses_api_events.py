"""Engine events -> the Responses API's stream events and its final ``response`` object.

One request is one prompt with one choice (``n`` is not a Responses field). Its output is a list of
items in the order the model wrote them: a ``message`` item (one ``output_text`` part) for text,
one ``function_call`` item per tool call (when the request has tools, the text goes through the
plan's :class:`~kvpark.server.tools.ToolCallParser`). Starting an item closes the one before it,
so the events of one item never interleave with another's, as the ``openai`` client expects.

Every event carries ``sequence_number`` (0, 1, ...). The stream opens with ``response.created``
and ``response.in_progress`` (on its first token: a refusal before it is still a plain 4xx) and
closes with ``response.completed``, or ``response.incomplete`` when the output ran into
``max_output_tokens``; that last object carries ``usage``, ``timings`` and the ``preempt`` record
(docs/server.md, "Streams") as the chat route's last chunk does. A failure after the first event
(a failed engine step, a drain that ran out of time) closes it with an ``error`` event and then
``response.failed``, whose response has ``status: "failed"`` and ``error: {code, message}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpark.engine.outputs import FinishedEvent, TokenEvent
from kvpark.server.errors import APIError
from kvpark.server.responses import JSON, Tally
from kvpark.server.tools import TextDelta, ToolCallDelta, ToolCallParser


def _error_code(error: APIError) -> str:
    """The response's ``error.code`` in OpenAI's words (its ``ResponseError`` codes)."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "server_error" if error.status >= 500 else "invalid_prompt"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class MessageOut:
    id: str = field(default_factory=lambda: _item_id("msg"))
    text: str = ""
    done: bool = False

    def item(self, status: str) -> JSON:
        # an item just added has no part yet (OpenAI's output_item.added); a background
        # response read while it runs shows the text so far
        content = [] if status == "in_progress" and not self.text else [self.part()]
        return {
            "type": "message",
            "id": self.id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def part(self) -> JSON:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}


@dataclass
class CallOut:
    call_id: str
    name: str
    id: str = field(default_factory=lambda: _item_id("fc"))
    arguments: str = ""
    done: bool = False

    def item(self, status: str) -> JSON:
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
            "status": status,
        }


class ResponsesBuilder:
    """Accumulates one response's output and renders its events (a :class:`StreamBuilder`)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        echo: JSON,
        parser: ToolCallParser | None,
        with_preempt: bool = False,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.echo = echo  # the request's settings the response object repeats
        self.parser = parser
        self.with_preempt = with_preempt
        self.created_at = int(time.time())
        self.items: list[MessageOut | CallOut] = []
        self.calls: dict[int, CallOut] = {}  # the parser's call index -> its item
        self.finish_reason: str | None = None
        self.tally = Tally()
        self.sequence = 0
        self.opened = False
        # told the response object once it has ended (completed, incomplete or failed): the store
        self.on_end: Callable[[JSON], None] | None = None

    # -- events in ------------------------------------------------------------------------------

    def on_tokens(self, prompt: int, event: TokenEvent) -> list[JSON]:
        events = [] if self.opened else self._open()
        if self.finish_reason is not None:
            return events  # nothing follows the end
        if event.text:
            if self.parser is None:
                events += self._text(event.text)
            else:
                for delta in self.parser.feed(event.text):
                    events += self._delta(delta)
        self.finish_reason = event.finish_reason
        return events

    def on_finished(self, event: FinishedEvent) -> None:
        self.tally.finished.append(event)

    def closing_chunks(self) -> list[JSON]:
        """The held-back text, every open item's ``done`` events, then the final event."""
        events = [] if self.opened else self._open()
        if self.parser is not None:
            for delta in self.parser.finish():
                events += self._delta(delta)
        events += self._close_last()
        final = self.response()
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        if self.on_end is not None:
            self.on_end(final)
        return [*events, self._event(kind, response=final)]

    def failed_events(self, error: APIError) -> list[JSON]:
        """An in-stream failure (after the first event): the ``error`` event, then
        ``response.failed`` with the response as far as it got."""
        event = self._event(
            "error", code=str(error.status), message=error.message, param=error.param
        )
        failed = self.failed(error)
        if self.on_end is not None:
            self.on_end(failed)
        return [event, self._event("response.failed", response=failed)]

    def failed(self, error: APIError) -> JSON:
        """The response as far as it got, failed with ``error``."""
        failed = self.response("failed")
        failed["error"] = {"code": _error_code(error), "message": error.message}
        return failed

    # -- objects out ----------------------------------------------------------------------------

    def response(self, status: str | None = None) -> JSON:
        """The response object: the whole answer, or (``status`` given) its state so far."""
        if status is None:
            status = "completed" if self.finish_reason in (None, "stop") else "incomplete"
        final = status in ("completed", "incomplete")  # the engine's tally is in
        ended = final or status in ("failed", "cancelled")
        output = [item.item("completed" if ended else "in_progress") for item in self.items]
        if status in ("incomplete", "failed", "cancelled") and output:
            output[-1]["status"] = "incomplete"  # the item the length limit (or failure) cut short
        texts = [item.text for item in self.items if isinstance(item, MessageOut)]
        obj: JSON = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "output_text": "".join(texts),
            "error": None,
            "incomplete_details": self._incomplete() if status == "incomplete" else None,
            **self.echo,
            "usage": self._usage() if final else None,
        }
        if final:
            obj["timings"] = self.tally.timings()
            if self.with_preempt:
                obj["preempt"] = self.tally.preempt()
        return obj

    def _incomplete(self) -> JSON:
        """Why the output stopped short: the length limit, or another engine finish (a grammar
        that reached a dead end: ``grammar_dead_end``) under its own name."""
        reason = self.finish_reason or "stop"
        return {"reason": "max_output_tokens" if reason == "length" else reason}

    def _usage(self) -> JSON:
        chat = self.tally.usage()
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"],
        }

    # -- rendering ------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: object) -> JSON:
        event: JSON = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _open(self) -> list[JSON]:
        self.opened = True
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    def _delta(self, delta: TextDelta | ToolCallDelta) -> list[JSON]:
        if isinstance(delta, TextDelta):
            return self._text(delta.text) if delta.text else []
        call = self.calls.get(delta.index)
        events: list[JSON] = []
        if call is None:
            call = CallOut(delta.id or _item_id("call"), delta.name or "")
            self.calls[delta.index] = call
            events += self._add(call)
        if delta.arguments:
            call.arguments += delta.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.id,
                    output_index=self.items.index(call),
                    delta=delta.arguments,
                )
            )
        return events

    def _text(self, text: str) -> list[JSON]:
        last = self.items[-1] if self.items else None
        events: list[JSON] = []
        if not isinstance(last, MessageOut) or last.done:
            last = MessageOut()
            events += self._add(last)
        last.text += text
        return [
            *events,
            self._event(
                "response.output_text.delta",
                item_id=last.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            ),
        ]

    def _add(self, item: MessageOut | CallOut) -> list[JSON]:
        """A new output item: the one before it is done first."""
        events = self._close_last()
        self.items.append(item)
        index = len(self.items) - 1
        events.append(
            self._event(
                "response.output_item.added", output_index=index, item=item.item("in_progress")
            )
        )
        if isinstance(item, MessageOut):
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=empty,
                )
            )
        return events

    def _close_last(self) -> list[JSON]:
        if not self.items or self.items[-1].done:
            return []
        item = self.items[-1]
        item.done = True
        index = len(self.items) - 1
        events: list[JSON] = []
        if isinstance(item, MessageOut):
            where = {"item_id": item.id, "output_index": index, "content_index": 0}
            events.append(
                self._event("response.output_text.done", **where, text=item.text, logprobs=[])
            )
            events.append(self._event("response.content_part.done", **where, part=item.part()))
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.arguments,
                )
            )
        # only the end of the output closes an item the length limit cut short
        status = "completed" if self.finish_reason in (None, "stop") else "incomplete"
        done = self._event("response.output_item.done", output_index=index, item=item.item(status))
        return [*events, done]

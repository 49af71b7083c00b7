"""Engine events -> an Anthropic ``message`` and its stream events.

A stream is ``message_start``, ``ping``, then for each content block ``content_block_start``,
``content_block_delta``\\ s (``text_delta`` for text, ``input_json_delta`` for a tool call's
arguments) and ``content_block_stop``, then ``message_delta`` (stop reason, usage, and kvpark's
``timings`` and ``preempt`` record) and ``message_stop``. The whole message of a non-streamed
request is built from the same blocks, so both agree by construction.

With tools, a choice's text goes through the request's :class:`ToolCallParser`: text comes out as
text blocks and each call as a ``tool_use`` block (``input`` parsed from the call's arguments). A
call that ``max_tokens`` cut short ends the message with ``stop_reason: "max_tokens"``; its block
keeps ``input: {}`` and the arguments text generated so far as ``partial_input``.

Stop sequences: the engine cuts a matched stop string from the text without saying which one
matched. The generated token ids still hold it, so the sequence is found by decoding them and
looking past the emitted text; a stop with nothing there was the end-of-turn token.
"""

from __future__ import annotations

import json
from typing import Any

from kvpark.engine.outputs import FinishedEvent, TokenEvent
from kvpark.server.protocol import TokenizerLike
from kvpark.server.responses import JSON, Tally
from kvpark.server.tools import Delta, TextDelta, ToolCallParser, ToolPlan

# a decode of the whole output may differ from the streamed text by a few characters at the cut
# (a byte-level token split across the stop string): look for the stop this far back too
STOP_SLACK = 8


class MessageBuilder:
    """One request's Anthropic message, built from its (single) choice's token events."""

    def __init__(
        self,
        message_id: str,
        model: str,
        input_tokens: int,
        stop: tuple[str, ...],
        tokenizer: TokenizerLike,
        tools: ToolPlan | None = None,
        with_preempt: bool = False,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.stop = stop
        self.tokenizer = tokenizer
        self.parser: ToolCallParser | None = None if tools is None else tools.parser()
        self.with_preempt = with_preempt
        self.tally = Tally()
        self.blocks: list[dict[str, Any]] = []  # text blocks and tool_use blocks, in order
        self.arguments: dict[int, str] = {}  # block index -> a tool call's arguments text
        self.open = False  # whether the last block still takes deltas
        self.text: list[str] = []  # every emitted piece, for the stop-sequence search
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.started = False
        self.flushed = False

    # -- events in ------------------------------------------------------------------------------

    def on_tokens(self, prompt: int, event: TokenEvent) -> list[JSON]:
        if self.finish_reason is not None:
            return []  # nothing follows the end
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.finish_reason = event.finish_reason
        out = self._start_message()
        if self.parser is None:
            deltas: list[Delta] = [TextDelta(event.text)]
        else:
            deltas = self.parser.feed(event.text)
        out.extend(self._render(deltas))
        return out

    def on_finished(self, event: FinishedEvent) -> None:
        self.tally.finished.append(event)

    # -- objects out ----------------------------------------------------------------------------

    def closing_chunks(self) -> list[JSON]:
        out = self._start_message() + self._flush()
        if self.open:
            out.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
            self.open = False
        reason, sequence = self._stop_reason()
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append({"type": "message_delta", "delta": delta, "usage": self._usage()})
        out[-1].update(self._extras())
        out.append({"type": "message_stop"})
        return out

    def response(self) -> JSON:
        """The whole non-streamed message."""
        self._flush()
        reason, sequence = self._stop_reason()
        return {
            **self._envelope(),
            "content": [self._final_block(i, b) for i, b in enumerate(self.blocks)],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": self._usage(),
            **self._extras(),
        }

    # -- blocks ---------------------------------------------------------------------------------

    def _start_message(self) -> list[JSON]:
        if self.started:
            return []
        self.started = True
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0}
        message = {
            **self._envelope(),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _flush(self) -> list[JSON]:
        """What the parser held back, and an empty text block for an output with no block."""
        if self.flushed:
            return []
        self.flushed = True
        out = self._render(self.parser.finish()) if self.parser is not None else []
        if not self.blocks:
            out.extend(self._open_block({"type": "text", "text": ""}))
        return out

    def _render(self, deltas: list[Delta]) -> list[JSON]:
        out: list[JSON] = []
        for delta in deltas:
            if isinstance(delta, TextDelta):
                if not delta.text:
                    continue
                if not (self.open and self.blocks[-1]["type"] == "text"):
                    out.extend(self._open_block({"type": "text", "text": ""}))
                self.blocks[-1]["text"] += delta.text
                piece: JSON = {"type": "text_delta", "text": delta.text}
            else:
                if delta.id is not None or delta.name is not None:  # a call's first piece
                    block: dict[str, Any] = {
                        "type": "tool_use",
                        "id": delta.id,
                        "name": delta.name,
                        "input": {},
                    }
                    out.extend(self._open_block(block))
                    self.arguments[len(self.blocks) - 1] = ""
                if not delta.arguments:
                    continue
                self.arguments[len(self.blocks) - 1] += delta.arguments
                piece = {"type": "input_json_delta", "partial_json": delta.arguments}
            index = len(self.blocks) - 1
            out.append({"type": "content_block_delta", "index": index, "delta": piece})
        return out

    def _open_block(self, block: dict[str, Any]) -> list[JSON]:
        out: list[JSON] = []
        if self.open:
            out.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        self.blocks.append(block)
        self.open = True
        index = len(self.blocks) - 1
        out.append({"type": "content_block_start", "index": index, "content_block": {**block}})
        return out

    def _final_block(self, index: int, block: dict[str, Any]) -> JSON:
        if block["type"] != "tool_use":
            return dict(block)
        arguments = self.arguments.get(index, "") or "{}"
        try:
            return {**block, "input": json.loads(arguments)}
        except ValueError:  # cut short by max_tokens: what was generated, not a made-up object
            return {**block, "input": {}, "partial_input": arguments}

    # -- the end --------------------------------------------------------------------------------

    def _stop_reason(self) -> tuple[str, str | None]:
        if self.finish_reason == "length":  # a call cut short is no call to run
            return "max_tokens", None
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if self.finish_reason == "stop" and self.stop:
            sequence = self._matched_stop()
            if sequence is not None:
                return "stop_sequence", sequence
        if self.finish_reason not in (None, "stop", "abort"):
            return self.finish_reason, None  # the engine's own reason (grammar_dead_end): said
        return "end_turn", None

    def _matched_stop(self) -> str | None:
        """The stop string that ended the output: the first one past the emitted text."""
        emitted = len("".join(self.text))
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        start = max(0, emitted - STOP_SLACK)
        hits = [(i, s) for s in self.stop if (i := full.find(s, start)) >= 0]
        return min(hits)[1] if hits else None

    def _usage(self) -> JSON:
        usage = self.tally.usage()
        prompt = int(usage["prompt_tokens"])  # type: ignore[call-overload]
        cached = sum(f.cached_tokens for f in self.tally.finished)
        if not self.tally.finished:  # failed before the end: what is known
            prompt = self.input_tokens
        # Anthropic counts cache reads apart: input_tokens + cache_read_input_tokens = the prompt
        return {
            "input_tokens": prompt - cached,
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached,
        }

    def _envelope(self) -> JSON:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model}

    def _extras(self) -> JSON:
        extras: JSON = {"timings": self.tally.timings()}
        if self.with_preempt:
            extras["preempt"] = self.tally.preempt()
        return extras

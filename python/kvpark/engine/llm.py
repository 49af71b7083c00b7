"""Offline generation: ``LLM(model=...).generate(prompts, params)`` and ``.chat(messages, params)``.

Every prompt is submitted at once and the engine batches them continuously, exactly as the server
does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpark.config.layers import EngineConfig
from kvpark.engine.llm_engine import LLMEngine, RequestRejected
from kvpark.engine.outputs import ErrorEvent, FinishedEvent, TokenEvent, TokenLogprob
from kvpark.runner.protocol import Runner, RunnerFactory
from kvpark.sampling.params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    error: str | None = None
    finished: FinishedEvent | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        runner: Runner | RunnerFactory | str | None = None,
        **engine_options: object,
    ) -> None:
        """``engine_options``: the fields of the layer configs by name (``kv_cells=2048``).
        ``runner``: a custom runner (docs/custom-runners.md), a factory called with the
        ``EngineConfig``, or ``"module:factory"`` as ``--runner`` takes it; None: the built-in."""
        if isinstance(runner, str):
            engine_options["runner"] = runner
            runner = None
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **engine_options), runner)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); returns outputs in prompt order."""
        batch: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [prompts]  # type: ignore[list-item]
        else:
            batch = list(prompts)  # type: ignore[arg-type]
        token_prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_prompts)
        return self._run(token_prompts, list(params))

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations: list[list[Message]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        prompts: list[Prompt] = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
            for c in conversations  # type: ignore[arg-type]
        ]
        return self.generate(prompts, params)

    def _run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, params, strict=True):
            self._counter += 1
            rid = f"llm-{self._counter}"
            order.append(rid)
            out = RequestOutput(rid, prompt, [Choice(j) for j in range(p.n)])
            outputs[rid] = out
            try:
                self.engine.check_request(prompt, p)
                self.engine.add_request(rid, prompt, p)
            except RequestRejected as e:
                out.error = e.message
        while self.engine.has_work:
            for rid, events in self.engine.step().items():
                out = outputs[rid]
                for ev in events:
                    if isinstance(ev, TokenEvent):
                        choice = out.choices[ev.index]
                        choice.text += ev.text
                        choice.token_ids += ev.token_ids
                        if ev.logprobs is not None:
                            choice.logprobs = (choice.logprobs or []) + ev.logprobs
                        choice.finish_reason = ev.finish_reason
                    elif isinstance(ev, FinishedEvent):
                        out.finished = ev
                    elif isinstance(ev, ErrorEvent):
                        out.error = ev.message
        return [outputs[rid] for rid in order]

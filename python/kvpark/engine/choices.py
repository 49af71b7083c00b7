"""Each choice's own output state, beside the scheduler's sequence: its generator, where it stands
in its grammar (structured output), and its text stream (detokenising, stop strings held back).

Keyed by (request id, choice index). A grammar advances only in :meth:`Choices.emit`, on tokens
drawn and emitted: a recompute replay samples nothing and a swap park touches no sampler state, so a
park leaves the constrained output as it is.
"""

from __future__ import annotations

from kvpark.engine.outputs import TokenEvent, TokenLogprob
from kvpark.sampling.grammar import DEAD_END, GrammarCompiler, GrammarState
from kvpark.sampling.params import SamplingParams
from kvpark.sampling.sampler import Generator, SampleRow, make_generator
from kvpark.sched.request import Request, Sequence
from kvpark.tokenizer.text_stream import TextStream
from kvpark.tokenizer.tokenizer import Tokenizer


def min_tokens_ban(params: SamplingParams, eos_ids: frozenset[int]) -> tuple[int, ...]:
    """What min_tokens masks: the tokens that would end the choice (EOS unless ignored)."""
    eos = () if params.ignore_eos else tuple(sorted(eos_ids))
    return tuple(sorted({*eos, *params.stop_token_ids}))


class Choices:
    def __init__(
        self, tokenizer: Tokenizer, grammars: GrammarCompiler, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._text: dict[tuple[str, int], TextStream] = {}
        self._generators: dict[tuple[str, int], Generator] = {}
        self._grammar: dict[tuple[str, int], GrammarState] = {}

    def open(self, req: Request) -> None:
        """Every choice of a new request: its generator, its grammar's start, its text stream."""
        p = req.params
        for j in range(p.n):
            self._generators[(req.request_id, j)] = make_generator(req.seed, j)
            if p.constraint is not None:
                self._grammar[(req.request_id, j)] = self.grammars.state(p.constraint)
            self._text[(req.request_id, j)] = TextStream(
                self.tokenizer, req.prompt_ids, p.stop, p.skip_special_tokens
            )

    def close(self, req: Request) -> None:
        for j in range(req.params.n):
            self._text.pop((req.request_id, j), None)
            self._generators.pop((req.request_id, j), None)
            self._grammar.pop((req.request_id, j), None)

    def sample_row(self, req: Request, seq: Sequence, choices: range | list[int]) -> SampleRow:
        """The draw of ``seq``'s next token for ``choices`` (all n before the prompt forks)."""
        p = req.params
        allowed = None
        state = self._grammar.get((req.request_id, choices[0]))
        if state is not None:  # before a fork every choice is at the start: one mask serves all
            allowed = state.allowed(self.vocab_size)
        banned = min_tokens_ban(p, self.tokenizer.eos_ids) if seq.num_output < p.min_tokens else ()
        return SampleRow(
            p,
            [self._generators[(req.request_id, j)] for j in choices],
            seq.output_ids,
            req.prompt_ids,
            allowed,
            banned,
        )

    def dead_end(self, req: Request, seq: Sequence) -> TokenEvent:
        """No token is allowed and the grammar is not complete (or min_tokens forbids its end)."""
        text = self._text[(req.request_id, seq.index)].finish()
        return TokenEvent(seq.index, text, [], None, DEAD_END)

    def emit(
        self, req: Request, seq: Sequence, token: int, logprob: TokenLogprob | None
    ) -> TokenEvent:
        """The event of a token drawn for (and already appended to) ``seq``; its finish reason is
        set when the token ends the choice."""
        p = req.params
        text_stream = self._text[(req.request_id, seq.index)]
        reason: str | None = None
        grammar_end = self._advance_grammar(req, seq, token)
        if (token in self.tokenizer.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
            text = text_stream.finish()
        else:
            text, stopped = text_stream.push(token)
            if stopped:
                reason = "stop"
            elif grammar_end is not None:
                reason = grammar_end
                text += text_stream.finish()
            elif seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
                text += text_stream.finish()
        return TokenEvent(
            seq.index, text, [token], [logprob] if logprob is not None else None, reason
        )

    def _advance_grammar(self, req: Request, seq: Sequence, token: int) -> str | None:
        """Commit an emitted token to the choice's grammar; the finish reason it implies: "stop"
        when the grammar is complete (once min_tokens are out: before that, its end is masked and
        the next draw finds a dead end), the dead end when it refused the token."""
        state = self._grammar.get((req.request_id, seq.index))
        if state is None:
            return None
        if not state.advance(token):
            return DEAD_END
        if state.complete and seq.num_output >= req.params.min_tokens:
            return "stop"
        return None

"""The declared OpenAI fields this server refuses, each with a 400 that names it and says why.

They are declared on the body models (rather than left to "unknown field") so the refusal can say
what to do instead, and so ``docs/server.md`` and the field-walk test see every field of the API.
"""

from __future__ import annotations

from kvpark.server.errors import bad_request
from kvpark.server.openai_bodies import ChatCompletionBody, CompletionBody, SamplingBody

# field -> why it is refused (any non-null value)
CHAT_REFUSED = {
    "audio": "audio is not supported: this server generates text only",
    "prediction": "prediction (predicted outputs) is not supported",
    "web_search_options": "web_search_options is not supported: this server has no web search",
    "reasoning_effort": "reasoning_effort is not supported: the served model has no effort knob",
    "verbosity": "verbosity is not supported: the served model has no verbosity knob",
    "prompt_cache_key": "prompt_cache_key is not supported: the prefix cache needs no key",
    "safety_identifier": "safety_identifier is not supported: this server keeps no safety records",
    "functions": "functions is deprecated and not supported: send tools instead",
    "function_call": "function_call is deprecated and not supported: send tool_choice instead",
}


def refuse_chat(body: ChatCompletionBody) -> None:
    for name, why in CHAT_REFUSED.items():
        if getattr(body, name) is not None:
            raise bad_request(why, name)
    if body.modalities is not None and body.modalities != ["text"]:
        raise bad_request('only modalities ["text"] is supported', "modalities")
    _refuse_best_of(body)


def refuse_completion(body: CompletionBody) -> None:
    _refuse_best_of(body)
    if body.echo and body.logprobs is not None:
        # the prompt's tokens would need logprobs too, which the engine does not compute
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")


def _refuse_best_of(body: SamplingBody) -> None:
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise bad_request("best_of other than n is not supported", "best_of")

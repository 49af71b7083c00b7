"""Gemma-style and Phi-3-style SentencePiece vocabularies for the tokenizer tests, built here (no
download): pieces learned by ``tokenizers``' BPE trainer on a small corpus, laid out as those
families' GGUFs lay them out (control tokens, user-defined tokens, the 256 byte tokens, then the
pieces, scored in merge order); their real chat templates; and ``spm_reference``, llama.cpp's way
of tokenizing such a vocabulary written out plainly, to check kvpark's against.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from kvpark.tokenizer.tokenizer import Tokenizer

CORPUS = [
    "user",
    "model",
    "Hello world",
    "Hello there, how are you?",
    "What is the capital of France?",
    "The capital of France is Paris.",
    "You are a helpful assistant.",
    "Tell me a joke about cats.",
    "model answers the user",
    "user asks the model",
    "Why did the chicken cross the road?",
    "I like cats and dogs.",
]
CONTROL, USER_DEFINED, BYTE, NORMAL = 3, 4, 6, 1
BYTES = [f"<0x{b:02X}>" for b in range(256)]

# Gemma 3's chat template: no system turn (a system message is folded into the first user turn),
# the assistant's turns are the "model"'s, and the template writes <bos> itself.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
# Phi-3-mini-instruct's.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "Tell me a joke about cats 😀"},
]
GEMMA_CHAT = (
    "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nWhat is the capital of France?"
    "<end_of_turn>\n<start_of_turn>model\nThe capital of France is Paris.<end_of_turn>\n"
    "<start_of_turn>user\nTell me a joke about cats 😀<end_of_turn>\n<start_of_turn>model\n"
)
PHI3_CHAT = (
    "<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nWhat is the capital of France?"
    "<|end|>\n<|assistant|>\nThe capital of France is Paris.<|end|>\n"
    "<|user|>\nTell me a joke about cats 😀<|end|>\n<|assistant|>\n"
)
TEXTS = [
    "",
    "Hello world",
    " Hello  world",
    "Hello   world    and\tcats",
    "a\n\nb\n\n\nc\n",
    "I like cats 😀 and café ☃",
    "<table>user</s><unk>",
]


def learned(prefix_scheme: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Pieces (the merges' results in merge order, then the alphabet) and the merges."""
    trainer_backend = Backend(models.BPE())
    trainer_backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prefix_scheme)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    trainer_backend.train_from_iterator(CORPUS * 20, trainer)
    model = json.loads(trainer_backend.to_str())["model"]
    merges = [(a, b) for a, b in model["merges"]]
    made = list(dict.fromkeys(a + b for a, b in merges))
    return made + sorted(set(model["vocab"]) - set(made)), merges


def _gguf(head: list[tuple[str, int]], pieces: list[str], **keys: Any) -> dict[str, Any]:
    """GGUF metadata: ``head`` (token, type), the byte tokens, then the pieces, scored as
    SentencePiece scores them (the earlier a piece is made, the higher); llama.cpp's converter
    gives added tokens -1000."""
    tokens = [t for t, _ in head] + BYTES + pieces
    types = [ty for _, ty in head] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [-1000.0 if ty == USER_DEFINED else 0.0 for _, ty in head] + [0.0] * 256
    scores += [-float(i) for i in range(len(pieces))]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
    }
    md.update({k if "." in k else f"tokenizer.ggml.{k}": v for k, v in keys.items()})
    return md


def gemma_metadata(eot_type: int = CONTROL) -> dict[str, Any]:
    head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", 2)]
    head += [("<start_of_turn>", CONTROL), ("<end_of_turn>", eot_type)]
    # Gemma's user-defined tokens: newlines, runs of spaces (spelled with spaces in its GGUFs),
    # HTML tags.
    head += [(t, USER_DEFINED) for t in ("\n", "\n\n", "  ", "   ", "<table>")]
    return _gguf(
        head,
        learned("never")[0],
        **{"general.architecture": "gemma3", "tokenizer.chat_template": GEMMA_TEMPLATE},
        bos_token_id=2,
        eos_token_id=1,
        unknown_token_id=3,
        padding_token_id=0,
        add_bos_token=True,
        add_space_prefix=False,
    )


PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"]


def phi3_metadata(added_type: int = CONTROL, add_bos: bool = False) -> dict[str, Any]:
    head = [("<unk>", 2), ("<s>", CONTROL), ("</s>", CONTROL)]
    md = _gguf(
        head,
        learned("always")[0],
        **{"general.architecture": "phi3", "tokenizer.chat_template": PHI3_TEMPLATE},
        bos_token_id=1,
        unknown_token_id=0,
        add_bos_token=add_bos,
    )
    # Phi-3 puts its chat tokens after the SentencePiece vocabulary (32000 and up).
    md["tokenizer.ggml.tokens"] += PHI3_ADDED
    md["tokenizer.ggml.token_type"] += [added_type] * len(PHI3_ADDED)
    md["tokenizer.ggml.scores"] += [-1000.0] * len(PHI3_ADDED)
    md["tokenizer.ggml.eos_token_id"] = md["tokenizer.ggml.tokens"].index("<|endoftext|>")
    return md


def spm_reference(md: dict[str, Any], text: str, *, phi3: bool) -> list[int]:
    """llama.cpp's tokenizing of a SentencePiece vocabulary: added (control, user-defined) tokens
    and <unk> cut out of the text first, longest first; each stretch between them spelled with ▁
    for spaces (Phi-3: a ▁ before each stretch, and its added tokens but <unk>, <s>,
    <|endoftext|> eat the whitespace after them); then the adjacent pair that makes the
    highest-scoring piece merged, leftmost first, until none does; what is left outside the
    vocabulary as its UTF-8 bytes."""
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, md["tokenizer.ggml.scores"], strict=True))
    added = sorted((t for t, ty in zip(tokens, types, strict=True) if ty in (2, 3, 4)), key=len)[
        ::-1
    ]
    out: list[int] = []

    def pieces(stretch: str) -> None:
        if not stretch:
            return
        symbols = list(("▁" if phi3 else "") + stretch.replace(" ", "▁"))
        while True:
            pairs = [(j, symbols[j] + symbols[j + 1]) for j in range(len(symbols) - 1)]
            best = max((p for p in pairs if p[1] in ids), key=lambda p: score[p[1]], default=None)
            if best is None:
                break
            symbols[best[0] : best[0] + 2] = [best[1]]
        for s in symbols:
            out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])

    stretch, i = "", 0
    while i < len(text):
        hit = next((t for t in added if text.startswith(t, i)), None)
        if hit is None:
            stretch, i = stretch + text[i], i + 1
            continue
        pieces(stretch)
        stretch, i = "", i + len(hit)
        out.append(ids[hit])
        if phi3 and hit not in ("<unk>", "<s>", "<|endoftext|>"):
            while i < len(text) and text[i].isspace():
                i += 1
    pieces(stretch)
    return out


def token_id(tok: Tokenizer, token: str) -> int:
    i = tok.backend.token_to_id(token)
    assert i is not None, token
    return int(i)


PHI3_TEXTS = [
    *TEXTS,
    PHI3_CHAT,
    "<|user|>\n  Hello<|end|>\n\n<|assistant|>",
    "<s> Hello</s>  world<|endoftext|> cats",
]

"""Which model ``kvpark serve`` runs and how it chats: the ``MODEL`` positional (``--model``'s twin)
and ``--chat-template FILE``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpark.tokenizer.tokenizer import compile_chat_template


def add_chat_template_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file that replaces the model's (docs/tool-calls.md)",
    )


def read_chat_template(path: str | None, p: argparse.ArgumentParser) -> str | None:
    """The template's text, compiled once here so a bad file exits 2 before the model loads."""
    if path is None:
        return None
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        p.error(f"--chat-template {path}: {getattr(exc, 'strerror', None) or exc}")
    try:
        compile_chat_template(source)
    except ValueError as exc:
        p.error(f"--chat-template {path}: {exc}")
    return source


def add_model_positional(p: argparse.ArgumentParser) -> None:
    """``kvpark serve MODEL``, as ``vllm serve MODEL``: the same as ``--model MODEL``."""
    p.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="GGUF file or Hugging Face directory, the same as --model (default: --model's)",
    )


def resolve_model_positional(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Fold ``MODEL`` into ``args.model``; exit 2 if ``--model`` names another one.

    A ``--model`` equal to the parser's default came from ``KVPARK_MODEL`` (or nowhere), and the
    positional, being on the command line, wins over it.
    """
    positional = getattr(args, "model_positional", None)
    if positional is None:
        return
    given_flag = args.model is not None and args.model != p.get_default("model")
    if given_flag and args.model != positional:
        p.error(f"MODEL {positional} and --model {args.model} differ: give one of them")
    args.model = positional

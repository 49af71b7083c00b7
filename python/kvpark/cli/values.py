"""How a flag's text becomes a value: the checked parsers every flag uses (a bad value exits 2
naming the flag), ``--help`` lines that end with their default, and ``apply_env``, which turns a
set ``KVPARK_<FLAG>`` into that flag's default so that the command line still wins.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection, Mapping

from kvpark.config import env
from kvpark.config.layers import DTYPE_NAMES


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Append each option's default to its help, worded for people: a switch reads ``on``/``off``,
    and a flag without a value says so, unless its help already says what its default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # Python 3.10's BooleanOptionalAction appends its own "(default: ...)"; word it as ours.
        text = (action.help or "").replace(" (default: %(default)s)", "")
        if action.default is argparse.SUPPRESS or "default:" in text or "%(default)" in text:
            return text
        if not action.option_strings and action.nargs != argparse.OPTIONAL:
            return text  # a required positional has no default
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None or action.default == []:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class Repeatable(argparse.Action):
    """A flag given once per value; the values given on the command line replace its default
    (what ``apply_env`` took from its variable, comma-separated) rather than add to it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def port(text: str) -> int:
    value = int_at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def one_of(*words: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in words:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(words)}")
        return text

    return parse


def canonical(names: Mapping[str, str]) -> Callable[[str], str]:
    """A flag spelt any way ``names`` knows: the canonical name it maps the spelling to."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}")
        return names[text]

    return parse


dtype_name = canonical(DTYPE_NAMES)


BUILT_IN_RUNNERS = ("auto", "lean", "torch")


def runner_spec(text: str) -> str:
    """``auto``, ``lean``, ``torch`` or ``module:factory``."""
    if text in BUILT_IN_RUNNERS:
        return text
    module, sep, name = text.partition(":")
    if not sep or not module.strip() or not name.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of {', '.join(BUILT_IN_RUNNERS)} nor of the form module:factory"
        )
    return text


def apply_env(
    p: argparse.ArgumentParser, environ: Mapping[str, str], dests: Collection[str] | None = None
) -> None:
    """Turn each set ``KVPARK_<FLAG>`` into that flag's default (so the command line still wins);
    ``dests`` limits this to some flags."""
    for action in p._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help" or (dests is not None and action.dest not in dests):
            continue
        name = env.flag_env_name(longs[0])
        text = environ.get(name)
        if text is None:
            continue
        try:
            if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
                value: object = env.parse_bool(text)
            elif isinstance(action, Repeatable):
                value = [part.strip() for part in text.split(",") if part.strip()]
            elif action.type is not None:
                value = action.type(text)  # type: ignore[operator]
            else:
                value = text
        except (argparse.ArgumentTypeError, ValueError) as exc:
            p.error(f"{name}={text!r}: {exc}")
        p.set_defaults(**{action.dest: value})

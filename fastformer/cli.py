"""What the command-line tools share: the --help formatter (one default per flag), argparse value types that
reject out-of-range numbers with an ``error:`` line (exit status 2) instead of a traceback later, and progress
bars that stay readable in a log.
"""
from __future__ import annotations

import argparse
import math
import sys

from tqdm import tqdm


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, which appends ``(default: X)`` to every flag's help, except
    where that would say nothing or say it twice:

    - the help already says its default in words, in the same form (``(default: standard input)``):
      argparse would append ``(default: None)`` after it;
    - the default is None (the flag is then optional with no value, and its help says what happens without
      it, where that is not plain);
    - the flag takes no value (``store_true``): "(default: False)" on a switch is noise.
    """

    def _get_help_string(self, action):
        help = action.help or ""
        if "(default:" in help or "%(default)" in help or action.default is None or action.nargs == 0:
            return help
        return super()._get_help_string(action)


def _number(kind, text: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_at_least(low: int):
    """argparse type: an integer >= low."""
    def parse(text: str) -> int:
        value = _number(int, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def float_at_least(low: float, *, exclusive: bool = False):
    """argparse type: a finite number >= low (> low when exclusive)."""
    def parse(text: str) -> float:
        value = _number(float, text)
        if value < low or (exclusive and value == low):
            raise argparse.ArgumentTypeError(f"{value} must be {'>' if exclusive else '>='} {low}")
        return value
    parse.__name__ = f"number {'>' if exclusive else '>='} {low}"
    return parse


def probability(text: str) -> float:
    """argparse type: a finite number in [0, 1) (dropout, label smoothing)."""
    value = _number(float, text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1)")
    return value


def progress(**kwargs) -> tqdm:
    """tqdm that refreshes ten times a second on a terminal and once a minute elsewhere (a log file, CI,
    nohup), so a long run's log holds a progress line a minute instead of thousands of refreshes."""
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 60.0)
        kwargs.setdefault("maxinterval", 120.0)
    return tqdm(**kwargs)


def usage_error(prog: str, message: str) -> None:
    """Exit as argparse does on a bad argument: ``<prog>: error: <message>`` on stderr, status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)

"""The command line's argparse conventions: one-line usage errors that point
to the right ``--help``, every option's default in its help, and a closed
stdout that is no error."""

from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn, Sequence

__all__ = ["CommandParser", "HelpFormat", "Parser", "argparse_message"]


class HelpFormat(argparse.HelpFormatter):
    """Help that names every option's default: an option taking a value whose help does
    not already say its default gets ``(default X)`` appended."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (``hybridkv replay: error: --hbm-gb must be
    > 0 (got -1); see 'hybridkv replay --help'``) instead of the usage block and then the error,
    and whose help names every default (:class:`HelpFormat`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormat)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {argparse_message(message)}; see '{self.prog} --help'\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        # A reader gone before the help is printed is no error: argparse itself
        # ignores it from Python 3.11 on, 3.10 raised (the same on every Python).
        try:
            super()._print_message(message, file)
        except OSError:
            pass


class CommandParser(Parser):
    """A subcommand's parser: an argument it does not know is its own error (``hybridkv
    replay: error: unrecognized arguments: --bogus; see 'hybridkv replay --help'``).
    argparse would hand the leftovers up, and the top-level parser would point at its
    own help, which does not list the subcommand's options."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def argparse_message(message: str) -> str:
    """``argument --hbm-gb: must be > 0 (got -1)`` -> ``--hbm-gb must be > 0 (got -1)``."""
    m = re.match(r"argument ([^:]+): (.*)", " ".join(message.split()))
    if not m:
        return message
    name, rest = m.groups()
    return f"{name} {rest}" if rest.startswith("must") else f"{name}: {rest}"

"""The ``kvpop`` command's reference (markdown), read from its argparse parsers.

``python -m kvpop.cli.reference > docs/cli.md`` writes it; ``tests/cli/test_cli_reference.py`` regenerates
it and compares, so the page says what the parsers accept.  Each subcommand gets its description and one
table per argument group: the option strings, the value's metavar or choices, the default and the help.
The text depends only on the parsers, never on the terminal width or the Python version.
"""
from __future__ import annotations

import argparse
import sys

from kvpop.cli import SUBCOMMANDS, build_parser

__all__ = ["render", "main"]

HEADER = ("# `kvpop` command reference\n\n"
          "Generated from the argparse parsers by `python -m kvpop.cli.reference > docs/cli.md` (do not edit; "
          "`tests/cli/test_cli_reference.py` checks it is current). `kvpop COMMAND --help` prints the same.\n")


def _cell(text: str) -> str:
    """One markdown table cell: a single line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(prog)s, %(choices)s ...
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = prog
        for key in ("choices",):
            if params.get(key) is not None:
                params[key] = ", ".join(map(str, params[key]))
        text = text % params
    return text


def _value(action: argparse.Action) -> str:
    """What the option takes: its choices, its metavar, or nothing for a flag."""
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    elif action.metavar is not None:
        value = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    else:
        value = action.dest.upper()
    if action.nargs in ("*", "+"):
        value += " ..."
    elif action.nargs == "?":
        value = f"[{value}]"
    if isinstance(action, argparse._AppendAction):
        value += " (repeatable)"
    return f"`{value}`"


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d is argparse.SUPPRESS or action.required:
        return ""
    if isinstance(d, (list, tuple)):
        return "`" + ",".join(map(str, d)) + "`" if d else ""
    return f"`{d}`"


def _names(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) if action.option_strings else (
        action.metavar if isinstance(action.metavar, str) else action.dest)
    return f"`{names}`" + (" (required)" if action.required and action.option_strings else "")


def _exclusive(parser: argparse.ArgumentParser) -> dict[int, int]:
    """action id -> the number of its mutually exclusive group (1, 2, ...), for a footnote."""
    out = {}
    for i, group in enumerate(parser._mutually_exclusive_groups, start=1):
        for action in group._group_actions:
            out[id(action)] = i
    return out


def _command(name: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## `kvpop {name}`", "", _cell(parser.description or ""), ""]
    exclusive = _exclusive(parser)
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = ("arguments" if group is parser._positionals
                 else "options" if group is parser._optionals else group.title)
        lines += [f"**{_cell(title)}**", ""]
        if group.description:
            lines += [_cell(group.description), ""]
        lines += ["| option | value | default | help |", "|---|---|---|---|"]
        for a in actions:
            help_text = _help(a, parser.prog)
            if id(a) in exclusive:
                help_text += f" (excludes the other options marked {exclusive[id(a)]})"
                names = _names(a) + f" [{exclusive[id(a)]}]"
            else:
                names = _names(a)
            lines.append(f"| {names} | {_value(a)} | {_cell(_default(a))} | {_cell(help_text)} |")
        lines.append("")
    return lines


def render() -> str:
    """The reference of every ``kvpop`` subcommand, in the order of ``kvpop --help``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = [HEADER, _cell(parser.description or ""), "", "| command | what it does |", "|---|---|"]
    lines += [f"| [`kvpop {name}`](#kvpop-{name}) | {_cell(help_text)} |"
              for name, (_, help_text) in SUBCOMMANDS.items()]
    lines.append("")
    for name in SUBCOMMANDS:
        lines += _command(name, sub.choices[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print("usage: python -m kvpop.cli.reference > docs/cli.md   (takes no arguments)", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

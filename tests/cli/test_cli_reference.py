"""docs/cli.md is what ``python -m kvpop.cli.reference`` writes from the parsers today, and it names every
option of every ``kvpop`` subcommand."""
import argparse
from pathlib import Path

from kvpop.cli import SUBCOMMANDS, build_parser, reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
REGENERATE = "python -m kvpop.cli.reference > docs/cli.md"


def test_docs_cli_md_is_current():
    assert DOC.exists(), f"docs/cli.md is missing: write it with `{REGENERATE}`"
    assert DOC.read_text(encoding="utf-8") == reference.render(), (
        f"docs/cli.md is not what the kvpop parsers say now (an option was added, removed or changed): "
        f"regenerate it with `{REGENERATE}` and commit it")


def test_reference_names_every_option_and_its_help():
    text = reference.render()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(SUBCOMMANDS)
    for name, p in sub.choices.items():
        section = text.split(f"## `kvpop {name}`\n", 1)[1].split("\n## ", 1)[0]
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or action.help is argparse.SUPPRESS:
                continue
            names = ", ".join(action.option_strings) or action.metavar or action.dest
            row = next((line for line in section.splitlines() if line.startswith(f"| `{names}`")), None)
            assert row is not None, (name, action.option_strings or action.dest)
            if action.help and "%" not in action.help:
                assert " ".join(action.help.split()).replace("|", "\\|") in row, (name, action.option_strings)


def test_reference_command_refuses_arguments(capsys):
    assert reference.main(["--check"]) == 2
    assert REGENERATE in capsys.readouterr().err

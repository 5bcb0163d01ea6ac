"""Every relative link of README.md and docs/*.md points to a file that exists, and every ``#anchor`` into a
markdown page to one of its headings (GitHub's rule for heading anchors)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code (where brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchor_rule():
    page = ROOT / "README.md"
    assert "your-own-model-end-to-end" in anchors(page)
    assert "quickstart" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with the anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def _kvpop_commands(page: Path) -> list[list[str]]:
    """The arguments of every ``kvpop ...`` (or ``torchrun/python -m kvpop ...``) command in the page's bash
    blocks."""
    import shlex

    from test_readme import _commands

    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        for cmd in _commands(block):
            for part in cmd.split("&&"):
                if not re.match(r"\s*(kvpop |torchrun |python3? -m kvpop )", part):
                    continue
                argv = shlex.split(part, comments=True)
                if argv[:1] == ["kvpop"]:
                    out.append(argv[1:])
                elif argv[:1] in (["torchrun"], ["python"], ["python3"]) and "-m" in argv:
                    at = argv.index("-m")
                    if argv[at + 1:at + 2] == ["kvpop"]:
                        out.append(argv[at + 2:])
    return out


def test_commands_of_the_pages_parse():
    """Every kvpop command the pages show is accepted by today's parsers (an option renamed or removed
    breaks this test, not the reader)."""
    from kvpop.cli import build_parser

    parser = build_parser()
    commands = [(page, argv) for page in PAGES for argv in _kvpop_commands(page)]
    assert {argv[0] for _, argv in commands} >= {"demo", "train", "eval", "schedule"}
    bad = []
    for page, argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit:
            bad.append(f"{page.relative_to(ROOT)}: kvpop {' '.join(argv)}")
    assert not bad, "commands the parsers refuse (see the error above each): " + "; ".join(bad)

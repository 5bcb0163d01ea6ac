"""Issue 40, items 7, 9-12: a new user's first hour (README as written) and ``kvpop eval`` with a user's runs."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_examples_pass_the_cache_under_the_keyword_the_installed_transformers_takes():
    import kvpop
    from kvpop.models import cache_kwarg_name

    sentinel = object()
    assert kvpop.cache_kwargs(sentinel) == {cache_kwarg_name(): sentinel}
    blocks = [(p.name, code) for p in PAGES
              for code in re.findall(r"```python\n(.*?)```", p.read_text(encoding="utf-8"), flags=re.S)]
    assert blocks
    stale = [name for name, code in blocks if "past_key_values=" in code]
    assert not stale, f"examples passing past_key_values= (warns on transformers >= 5.24): {stale}"


def test_what_the_readme_commands_write_is_ignored_by_git():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    written = set(re.findall(r"--out ([\w./-]+)", text)) | set(re.findall(r"> ([\w-]+\.jsonl)", text))
    written |= set(re.findall(r"save_pretrained\('([\w-]+)'\)", text))
    written = {w.split("/")[0] for w in written if not w.startswith("/") and w != "DIR"}
    assert {"demo-out", "eval-out", "my-model", "runs", "train.jsonl", "traces.jsonl"} <= written
    if not (ROOT / ".git").exists():
        return
    paths = sorted(w if w.endswith(".jsonl") else w + "/" for w in written)  # the commands make directories
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    ignored = {x.rstrip("/") for x in r.stdout.split()}
    assert ignored == written, f"not in .gitignore: {sorted(written - ignored)}"


def test_readme_walkthrough_says_the_default_scorer_is_the_mlp():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "the method's recipe, kvpop train's default" not in text
    from kvpop.core.config import KVpopConfig

    assert KVpopConfig().scorer == "mlp" and "kvpop train's default is the MLP" in text


def test_demo_help_says_lookahead_has_a_shipped_model(capsys):
    from kvpop.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["demo"]
    help_text = " ".join(sub.format_help().split())
    assert "lookahead needs --model" not in help_text and "tiny_qwen3_lookahead" in help_text
    assert (ROOT / "kvpop" / "data" / "tiny_qwen3_lookahead" / "config.json").is_file()


def test_docs_name_model_directories_not_bare_hub_names():
    bare = [(p.name, m) for p in PAGES for m in re.findall(r"--model (Qwen[\w.-]*)", p.read_text(encoding="utf-8"))]
    assert not bare, bare

"""Every Python example of README.md and of the pages in docs/ runs as written (on the PyTorch CPU path);
the examples cover every public entry point; the README's test command is the one CI runs."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# (page, index on the page, code) of every ```python block (```python vllm blocks run in tests/vllm/)
BLOCKS = [(page.relative_to(ROOT).as_posix(), i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S))]
# every public entry point has an example that runs as written
ENTRY_POINTS = ("kvpop.patch(", "kvpop.patched(", "kvpop.KVpopCache(", "kvpop.distill_loss(", "kvpop.score_loss(",
                "kvpop.save_scorers(", "kvpop.load_scorers(", "dms.DMSCache(", "eviction_schedule(",
                "eviction_decisions(", "visible_at(", "sparse_attention(", "future_attention_target(",
                "fixed_budget_decode(", "ragged_paged_decode(")


def test_examples_cover_every_entry_point():
    assert len(BLOCKS) >= 4
    missing = [name for name in ENTRY_POINTS if not any(name in code for _, _, code in BLOCKS)]
    assert not missing, f"no ```python example in README.md or docs/*.md calls {missing}"


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{page}[{i}]" for page, i, _ in BLOCKS])
def test_example_runs(page, index, code, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels are tested on their own
    monkeypatch.chdir(tmp_path)  # examples may write files
    exec(compile(code, f"{page}[python block {index}]", "exec"), {"__name__": "__readme__"})


def test_readme_test_command_is_the_one_ci_runs():
    """The quickstart's test command and the line of .ci/run under its "# --- the README's test command" run
    the same pytest arguments."""
    quick = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    readme_cmd = re.findall(r"python3? (-m pytest [^&|;\n]*)", quick)
    assert len(readme_cmd) == 1, "the README's Quickstart needs exactly one `python -m pytest ...` command"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(ci) if line.startswith("# --- the README's test command"))
    assert ci[at + 1].strip() == f"python3 {readme_cmd[0].strip()}", (
        f"README.md runs `python {readme_cmd[0].strip()}`, .ci/run runs `{ci[at + 1].strip()}`: keep them in sync")


def test_readme_capacity_table_is_the_functions_output():
    from kvpop.core.capacity import capacity_table

    table = capacity_table()
    assert table in (ROOT / "docs" / "library.md").read_text(encoding="utf-8"), (
        "paste the table of python -m kvpop.core.capacity into docs/library.md")


RESULTS = ROOT / "kvpop" / "data" / "demo_results"


def test_results_document_holds_each_runs_table():
    doc = (RESULTS / "README.md").read_text(encoding="utf-8")
    for task in ("kvtrace", "lookahead"):
        for line in (RESULTS / task / "table.md").read_text(encoding="utf-8").splitlines():
            assert not line.startswith("|") or line in doc, (task, line)


WALKTHROUGH = "# your own model, end to end"


def _commands(block: str) -> list[str]:
    """The commands of a bash block: comments dropped, backslash continuations joined."""
    out, cur = [], ""
    for line in block.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        out.append(cur.strip())
        cur = ""
    return out


def _run_walkthrough(block, main, tmp_path):
    """Run the walkthrough's commands in this process; the programs they ran."""
    import contextlib
    import io
    import shlex

    ran = []
    for cmd in _commands(block):
        argv = shlex.split(cmd)
        if argv[0] == "kvpop":
            assert main(argv[1:]) == 0, cmd
        else:
            assert argv[:2] == ["python", "-c"], f"the walkthrough runs kvpop and python -c only: {cmd}"
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(argv[2], "README walkthrough", "exec"), {"__name__": "__readme__"})
            if len(argv) == 5 and argv[3] == ">":
                (tmp_path / argv[4]).write_text(buf.getvalue())
            else:
                assert len(argv) == 3, cmd
        ran.append(argv[0])
    assert ran.count("kvpop") >= 4
    return ran


def test_readme_own_model_walkthrough_runs(monkeypatch, tmp_path, capsys):
    """The README's train-and-eval walkthrough, command by command (``kvpop`` in this process, ``python -c``
    with its ``> FILE``), on its stand-in model and traces; every DMS run reaches its target keep."""
    import json

    from kvpop.cli import main

    blocks = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
              if b.startswith(WALKTHROUGH)]
    assert len(blocks) == 1, f"README.md needs one bash block starting with {WALKTHROUGH!r}"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.chdir(tmp_path)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the figures the README shows were made on one thread (sums split differently)
    try:
        _run_walkthrough(blocks[0], main, tmp_path)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "missed its target" not in err, err
    # the tables the README shows are the ones this run printed, exactly
    table = (tmp_path / "eval-out" / "table.md").read_text(encoding="utf-8")
    shown = re.search(r"<!-- walkthrough:start[^>]*-->\n(.*?)<!-- walkthrough:end -->",
                      README.read_text(encoding="utf-8"), flags=re.S)
    assert shown, "README.md needs the walkthrough's tables between <!-- walkthrough:start --> and :end markers"
    assert shown.group(1).strip() == table.strip(), (
        "README.md's walkthrough tables differ from what the block prints today; paste eval-out/table.md "
        f"between the markers (then python -m freshness stamp README.md#walkthrough):\n{table}")
    res = json.loads((tmp_path / "eval-out" / "results.json").read_text())
    assert {"kvpop-mlp", "kvpop-mlstm-joint", "dms"} <= {r["policy"] for r in res["rows"]}
    assert res["trained"]["kvpop-mlp"]["window"] == res["window"]


def test_readme_reads_top_down():
    """What it is, the two commands, a Python example within the first 120 lines, the own-model path, then the
    evidence; at most 300 lines."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; keep it at most 300 (move detail to docs/)"
    first_python = next(i for i, line in enumerate(lines) if line.startswith("```python"))
    assert first_python < 120, f"README.md: first Python example at line {first_python + 1}; keep it in the first 120"
    heads = [line for line in lines if line.startswith("## ")]
    order = ["## Quickstart", "## In Python", "## Your own model, end to end", "## What you get"]
    assert [h for h in heads if h in order] == order, heads


def _claim_section() -> str:
    text = README.read_text(encoding="utf-8")
    return text.split("### Does *learning* the priority matter?", 1)[1].split("\n### ", 1)[0]


def test_readme_realtext_controls_table_is_the_records():
    """The README's table of the same-structure controls reads the once-scored fresh split's record (NLL over
    the original dense model, the mean over seeds), every interval it quotes is a comparison of that record
    (or of the validation record) with a verdict other than "no difference shown", and the verdicts its words
    give at 12.5 % are the record's."""
    import json

    ev = ROOT / "studies" / "results" / "evidence" / "realtext"
    test = json.loads((ev / "fresh2.json").read_text())
    valid = json.loads((ev / "controls.json").read_text())
    fig = {(f["row"], f["budget"]): f["vs_original_mean"] for f in test["figures"]}
    rows = re.findall(r"^\| `([^`]+)`[^|]*\| ([+-][0-9.]+) \| ([+-][0-9.]+) \| ([+-][0-9.]+) \|$", _claim_section(),
                      flags=re.M)
    assert len(rows) >= 7, rows
    for name, *vals in rows:
        row = "fixed-finetune[keynorm]" if name == "fixed-finetune[keynorm+]" else name  # the sign it chose
        for b, v in zip((64, 128, 256), vals):
            assert f"{fig[(row, b)]:+.4f}" == v, (name, b, fig[(row, b)], v)
    third = json.loads((ev / "fresh3.json").read_text())  # issue 44: the --lm-weight rows, scored once
    corpus2 = json.loads((ev.parent / "realtext2" / "fresh_corpus2.json").read_text())
    big = [json.loads(f.read_text())  # issue 44 item 4: the 3.2M model
           for f in (ev / "fresh3_3m.json", ev.parent / "realtext2" / "fresh_corpus2_3m.json")]
    exact = json.loads((ev / "paper_exact.json").read_text())  # issue 43 item 4: the paper's method exactly
    mlstm = json.loads((ev / "mlstm.json").read_text())  # the mLSTM scorer beside the MLP and recency
    decay = json.loads((ev / "decay.json").read_text())  # a fixed, stronger decay
    comps = [c for rec in (test, valid, third, corpus2, *big, *exact["tests"], *mlstm["splits"].values(),
                           *decay["splits"].values())
             for c in rec["comparisons"] + rec.get("oracle_against_control", [])]
    claim = " ".join(_claim_section().split())  # an interval may be wrapped over two lines
    quoted = re.findall(r"([+-][0-9.]+) \[([+-][0-9.]+), ([+-][0-9.]+)\]", claim)
    assert len(quoted) >= 6, quoted
    for mean, lo, hi in quoted:
        match = [c for c in comps if f"{c['mean_diff']:+.4f}" == mean and f"{c['ci95'][0]:+.4f}" == lo
                 and f"{c['ci95'][1]:+.4f}" == hi]
        assert match, (mean, lo, hi)
    # the mLSTM and fixed-decay sentences: their splits are their records' test splits, scored with 3 seeds
    assert "3 seeds, a fourth fresh split" in claim and "at 6.25 % on two fresh splits" in claim
    assert mlstm["splits"]["test_fresh4"]["test"] and mlstm["seeds"] == [0, 1, 2]
    assert all(decay["splits"][t]["test"] for t in ("test_fresh5", "test_fresh6")) and decay["seeds"] == [0, 1, 2]
    assert decay["selection"]["final"] and decay["selection"]["chosen"] == {"gamma": 0.995}
    assert "`--gamma-min 0.995 --gamma-max 0.995002 --gamma-init 0.995001`, chosen on validation" in claim
    # "ties it at 12.5 % on both, and at 25 % beats it on one but not the other; an untrained priority ties it"
    row, ctl, rnd = "kvpop-mlp-joint[lm 0.1,decay 0.995]", "fixed-finetune[streaming,lm 0.1]", \
        "fixed-finetune[random,lm 0.1,decay 0.995]"
    verdict = {(t, c["budget"], c["b"]): c["verdict"] for t in ("test_fresh5", "test_fresh6")
               for c in decay["splits"][t]["comparisons"] if c["a"] == row}
    assert [verdict[(t, 64, ctl)] for t in ("test_fresh5", "test_fresh6")] == ["a better"] * 2
    assert [verdict[(t, 128, ctl)] for t in ("test_fresh5", "test_fresh6")] == ["no difference shown"] * 2
    assert sorted(verdict[(t, 256, ctl)] for t in ("test_fresh5", "test_fresh6")) == ["a better", "no difference shown"]
    assert [verdict[("test_fresh6", b, rnd)] for b in (128, 256)] == ["no difference shown"] * 2
    # the words at 12.5 %: the control better; no difference shown against every other fine-tuned control
    at128 = {c["b"]: c["verdict"] for c in test["comparisons"]
             if c["reference"] == "original" and c["a"] == "kvpop-mlp-joint[auto]" and c["budget"] == 128}
    assert at128["fixed-finetune[streaming]"] == "b better"
    assert all(at128[b] == "no difference shown" for b in ("fixed-finetune[random]", "fixed-finetune[keynorm]",
                                                           "fixed-finetune[window-attention]"))
    # with the next-token loss: no difference shown against recency on test_fresh3, window attention better; on the
    # second corpus recency better; the words "does not beat a fine-tune under a fixed rule at 12.5 %" follow
    v3 = {c["b"]: c["verdict"] for c in third["comparisons"] if c["reference"] == "original" and c["budget"] == 128
          and c["a"] == "kvpop-mlp-joint[auto, lm 0.1]"}
    assert v3["fixed-finetune[streaming, lm 0.1]"] == "no difference shown"
    assert v3["fixed-finetune[window-attention, lm 1]"] == "b better"
    v2 = {c["b"]: c["verdict"] for c in corpus2["comparisons"] if c["reference"] == "original" and c["budget"] == 128
          and c["a"] == "kvpop-mlp-joint[auto, lm 0.1]"}  # not the oracle against the control
    assert v2["fixed-finetune[streaming, lm 0.1]"] == "b better"
    assert "does not beat a fine-tune under a fixed rule at 12.5 % memory" in " ".join(_claim_section().split())
    # issue 44 item 4: the same at 3.2M parameters on both corpora (no difference shown against the control)
    for rec in big:
        v = {c["b"]: c["verdict"] for c in rec["comparisons"] if c["reference"] == "original" and c["budget"] == 128
             and c["a"] == "kvpop-mlp-joint[auto, lm 0.1, 3.2M params]"}
        assert v["fixed-finetune[streaming, lm 0.1, 3.2M params]"] == "no difference shown"
    assert "at 0.82M parameters nor at 3.2M" in " ".join(_claim_section().split())
    # issue 43 item 4: the paper's method exactly ties recency on test_fresh2 at 12.5 %; its synthetic figures
    fresh2 = next(t for t in exact["tests"] if t["split"] == "test_fresh2")
    assert {c["verdict"] for c in fresh2["comparisons"] if c["budget"] == 128 and c["reference"] == "original"
            and c["b"] == "fixed-finetune[streaming]"} == {"no difference shown"}
    words = " ".join(_claim_section().split())
    for task in ("kvtrace", "lookahead"):
        rec = json.loads((ev.parent / task / "paper_exact.json").read_text())
        fig = next(f for f in rec["tests"][0]["figures"] if f["row"] == "kvpop-mlp-joint[paper-exact]")
        assert f"{task} {fig['mean']:.3f}" in words, (task, fig["mean"])


def test_readme_equal_bytes_row_is_the_records():
    """The README's 8-bit-at-equal-bytes row (issue 43 item 6) quotes each instrument's once-scored record: the
    figures, the interval and the verdicts at equal bytes."""
    import json

    line = next(x for x in README.read_text(encoding="utf-8").splitlines() if x.startswith("| 8-bit slots"))
    ev = ROOT / "studies" / "results" / "evidence"
    words = {"a better": "8-bit better", "no difference shown": "no difference shown"}
    for task, fmt in (("realtext", "{:+.4f}"), ("kvtrace", "{:.3f}"), ("lookahead", "{:.3f}")):
        test = json.loads((ev / task / "equal_bytes.json").read_text())["test"]
        fig = {f["row"]: f["mean"] for f in test["figures"]}
        eq = [c for c in test["comparisons"] if c["at"] == "equal bytes"]
        assert len({c["verdict"] for c in eq}) == 1, eq  # int8 and fp8 read alike
        c = next(c for c in eq if c["a"].startswith("int8"))
        label = "real text int8" if task == "realtext" else task
        assert f"{label} {fmt.format(fig[c['a']])} vs {fmt.format(fig[c['b']])}" in line, (task, fig)
        assert words[c["verdict"]] in line.split(label, 1)[1].split(";")[0], (task, c)
        if task == "realtext":
            assert f"{c['mean_diff']:+.4f} [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]" in line


def test_the_papers_rows_name_their_departures():
    """Issue 43 item 4: a row the ledger's tables (the README's, evidence.md's generated block) call the paper's
    recipe either is its exact method (``[paper-exact]``) or names how it departs; the plain
    ``kvpop-mlp-joint[paper]`` name appears in none of their rows (the records' own tables keep the name they
    were scored under)."""
    from studies.ledger import DEPARTURES

    ev = (ROOT / "studies" / "results" / "evidence.md").read_text(encoding="utf-8")
    block = ev.split("<!-- evidence:start", 1)[1].split("<!-- evidence:end")[0]
    for text in (README.read_text(encoding="utf-8"), block):
        rows = [x for x in text.splitlines() if x.startswith("| kvpop-mlp-joint[paper")]
        assert rows and not [x for x in rows if x.startswith("| kvpop-mlp-joint[paper] ")], rows
    table = README.read_text(encoding="utf-8")
    assert all(f"| {name} |" in table for name in DEPARTURES.values())

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


def walkthrough_bands() -> dict[str, float]:
    """The bands README states after the walkthrough's tables (docs/DESIGN.md section 14): ``{row label: band}``,
    a policy's row by its name, a DMS-table row as ``entries B=N``."""
    text = README.read_text(encoding="utf-8")
    para = re.search(r"<!-- walkthrough:end -->\n+(.*?)\n\n", text, flags=re.S)
    assert para and "band" in para.group(1), "README states the walkthrough's bands right after its tables"
    para = " ".join(para.group(1).split())
    bands = {m[0]: float(m[1]) for m in re.findall(r"`([\w-]+)` ±([\d.]+)", para)}
    bands.update({f"entries {m[0]}": float(m[1]) for m in re.findall(r"(B=\d+) ±([\d.]+)", para)})
    assert bands, f"no band found in README's paragraph after the walkthrough: {para}"
    return bands


def _same_within_bands(shown: str, printed: str, bands: dict[str, float]) -> None:
    """Every line of README's tables is the printed one; a row README gives a band may differ by at most it in
    each number (the same numbers in the same places otherwise)."""
    from freshness.kernel_sets import table_numbers

    hint = ("README.md's walkthrough tables differ from what the block prints today beyond the stated bands; paste "
            "eval-out/table.md between the markers and measure the bands again (python -m freshness.kernel_sets "
            f"walkthrough; then python -m freshness stamp README.md#walkthrough):\n{printed}")
    a, b = shown.splitlines(), printed.splitlines()
    assert len(a) == len(b), hint
    got, want = table_numbers(printed), table_numbers(shown)
    for la, lb in zip(a, b):
        if la == lb:
            continue
        label = la.strip("|").split("|")[0].strip() if la.startswith("|") else None
        label = f"entries {label}" if label and label.startswith("B=") else label
        assert label in bands, f"row {label!r} is not one README gives a band, and it differs:\n{lb}\n{hint}"
        head = 1 if label.startswith("entries") else 2  # the label cells: equal, not within a band
        assert la.split("|")[:head + 1] == lb.split("|")[:head + 1] and _NUM_FREE.sub("#", la) == _NUM_FREE.sub(
            "#", lb), hint
        worst = max(abs(x - y) for x, y in zip(got[label], want[label]))
        assert worst <= bands[label] + 1e-9, f"{label}: moved {worst:.4f}, band {bands[label]}:\n{lb}\n{hint}"


_NUM_FREE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def test_walkthrough_band_check_accepts_a_move_within_its_band_and_nothing_else():
    shown = ("| policy | trained at | B=32 |\n|---|---|---|\n| dense (NLL) | - | 3.3455 |\n"
             "| dms | keep 0.125 | +0.1618 / 0.964 |\n\n| budget | last position |\n|---|---|\n"
             "| B=32 | 31.8 [21, 44] |")
    _same_within_bands(shown, shown.replace("+0.1618", "+0.2281").replace("[21, 44]", "[22, 41]"),
                       {"dms": 0.1, "entries B=32": 3})
    for printed, bands in ((shown.replace("+0.1618", "+0.3000"), {"dms": 0.1}),          # past the band
                           (shown.replace("3.3455", "3.3456"), {"dms": 0.1}),            # a row without a band
                           (shown.replace("[21, 44]", "[21, 48]"), {"entries B=32": 3}),  # the DMS table's band
                           (shown.replace("keep 0.125", "keep 0.2"), {"dms": 1.0})):     # another label
        with pytest.raises(AssertionError):
            _same_within_bands(shown, printed, bands)


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
    # the tables the README shows are the ones this run printed: exactly, but for the rows README gives a band
    table = (tmp_path / "eval-out" / "table.md").read_text(encoding="utf-8")
    shown = re.search(r"<!-- walkthrough:start[^>]*-->\n(.*?)<!-- walkthrough:end -->",
                      README.read_text(encoding="utf-8"), flags=re.S)
    assert shown, "README.md needs the walkthrough's tables between <!-- walkthrough:start --> and :end markers"
    _same_within_bands(shown.group(1).strip(), table.strip(), walkthrough_bands())
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


def _quoted_comparisons() -> list[dict]:
    """Every paired interval of the records the README's claims may quote: the real-text studies' (test splits and
    the validation record) and the synthetic tasks' fresh splits."""
    import json

    ev = ROOT / "studies" / "results" / "evidence"
    recs = [json.loads((ev / "realtext" / "controls.json").read_text())]
    for f in ("fresh2", "fresh3", "fresh3_3m"):
        recs.append(json.loads((ev / "realtext" / f"{f}.json").read_text()))
    for f in ("fresh_corpus2", "fresh_corpus2_3m"):
        recs.append(json.loads((ev / "realtext2" / f"{f}.json").read_text()))
    recs += json.loads((ev / "realtext" / "paper_exact.json").read_text())["tests"]
    for f in ("mlstm", "decay"):
        recs += json.loads((ev / "realtext" / f"{f}.json").read_text())["splits"].values()
    for task in ("kvtrace", "lookahead"):
        recs.append(json.loads((ev / task / "fresh_test.json").read_text()))
    recs.append(json.loads((ev / "lookahead" / "controls_adaptive.json").read_text()))  # head-adaptive controls
    return [c for rec in recs for c in rec["comparisons"] + rec.get("oracle_against_control", [])]


def test_readme_realtext_claims_are_the_records():
    """Issue 61 item 3: the README's claims block is ``python -m studies.claims``'s rendering of the records; every
    interval the section quotes (table and words) is a comparison of a record; every seed-level interval beside one
    is :func:`studies.paired.seed_t_interval` of that comparison's per-seed figures; an interval with a bound within
    0.0005 of 0 says "borderline"; a split scored again by a later study says so."""
    from studies import claims as C
    from studies.paired import BORDERLINE

    section = _claim_section()
    block = section.split(C.CLAIMS_START, 1)[1].split(C.CLAIMS_END, 1)[0]
    assert block == "\n" + C.readme_block(), "regenerate: python -m studies.evidence readme --write-shipped"
    comps = _quoted_comparisons()
    claim = " ".join(section.split())  # an interval may be wrapped over two lines
    quoted = re.findall(r"([+-][0-9.]+) \[([+-][0-9.]+), ([+-][0-9.]+)\]", claim)
    assert len(quoted) >= 3 * len(C.README_PAIRS) + 2, quoted
    for mean, lo, hi in quoted:
        match = [c for c in comps if f"{c['mean_diff']:+.4f}" == mean and f"{c['ci95'][0]:+.4f}" == lo
                 and f"{c['ci95'][1]:+.4f}" == hi]
        assert match, (mean, lo, hi)
        near = min(abs(x) for x in match[0]["ci95"]) <= BORDERLINE  # the record's bounds, not their rounding
        after = claim.split(f"{mean} [{lo}, {hi}]", 1)[1][:40].split("[", 1)[0]
        assert near == ("borderline" in after), (mean, lo, hi, after)
    # every cell of the table: its seed-level interval is the t-interval of the same comparison's per-seed figures
    cl = {(c["split"], c["a"], c["b"], c["budget"]): c for c in C.claims(C.load_sources())}
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert len(rows) == len(C.README_PAIRS)
    for line, (split, a, b, _) in zip(rows, C.README_PAIRS):
        cells = [x.strip() for x in line.strip("|").split("|")][2:]
        assert line.startswith(f"| `{split}` (")
        for bud, text in zip((64, 128, 256), cells):
            c = cl[(split, a, b, bud)]
            assert text.startswith(f"{c['mean_diff']:+.4f} [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]"), text
            s = c["seeds"]
            assert f"seeds [{s['ci95'][0]:+.4f}, {s['ci95'][1]:+.4f}]" in text, (split, a, b, bud)
        history = line.split("(", 1)[1].split(")", 1)[0]
        assert history == cl[(split, a, b, 128)]["history"]
        # the splits later studies scored again are named so (issue 61: test_fresh2, test_fresh3)
        if split in ("test_fresh2", "test_fresh3", "test_corpus2"):
            assert "scored again" in history, line
    # the words: no learned row beats recency at 12.5 % on any split; at 6.25 % by both intervals on test_fresh4-6,
    # by the bootstrap alone on test_fresh2, on neither test_fresh3 nor the second corpus
    recency = [p for p in C.README_PAIRS if "recency" in p[3] and not p[1].startswith("oracle")]
    assert all(not cl[(s, a, b, 128)]["strength"].startswith("a better") for s, a, b, _ in recency)
    assert "does not beat a fine-tune under a fixed rule at 12.5 % memory" in claim

    def both(s, a, b):
        c = cl[(s, a, b, 64)]
        return c["strength"] == "a better" and c["seeds"]["ci95"][1] < 0

    at64 = {s: (cl[(s, a, b, 64)]["strength"] == "a better", both(s, a, b)) for s, a, b, _ in recency
            if "3.2M" not in _}
    assert at64["test_fresh4"] == at64["test_fresh5"] == at64["test_fresh6"] == (True, True)
    assert at64["test_fresh2"] == (True, False)
    assert not any(cl[(s, a, b, 64)]["strength"] == "a better" for s, a, b, _ in recency
                   if s in ("test_fresh3", "test_corpus2"))
    assert "by both intervals on `test_fresh4`, `test_fresh5` and `test_fresh6`" in claim
    assert "by the bootstrap alone on `test_fresh2`, on neither `test_fresh3` nor the second corpus" in claim
    assert "`--gamma-min 0.995 --gamma-max 0.995002 --gamma-init 0.995001`, chosen on validation" in claim
    assert "at 0.82M parameters nor at 3.2M" in claim
    # the exact label within 0.012 nats of recency at 12.5 % on the splits the table shows it
    ex = [cl[(s, a, b, 128)] for s, a, b, _ in C.README_PAIRS if a.startswith("oracle")]
    assert ex and all(abs(c["mean_diff"]) < 0.012 for c in ex)
    import json

    ev = ROOT / "studies" / "results" / "evidence" / "realtext"
    # the synthetic words: lookahead's and kvtrace's fresh splits, the paper's rows
    fresh = {t: json.loads((ev.parent / t / "fresh_test.json").read_text()) for t in ("kvtrace", "lookahead")}
    mean = {(t, f["row"]): f["mean"] for t, r in fresh.items() for f in r["figures"]}
    look = "kvpop-mlp-joint[max,paper-decay,adaptive,teacher]"
    assert f"teacher label: {mean[('lookahead', look)]:.3f}" in claim
    # given the row's head-adaptive budgets (controls_adaptive.json), the key-norm fine-tune beats it
    ad = json.loads((ev.parent / "lookahead" / "controls_adaptive.json").read_text())
    kn = next(f for f in ad["figures"] if f["row"] == "fixed-finetune[keynorm]")
    assert f"the key-norm fine-tune scores {kn['mean']:.3f}" in claim
    c = next(c for c in ad["comparisons"] if c["a"] == look and c["b"] == "fixed-finetune[keynorm]")
    assert c["strength"].startswith("b better") and "the lead was the budgets, not the learned" in claim
    assert all(v == 1.0 for v in next(f for f in fresh["kvtrace"]["figures"]
                                      if f["row"] == "fixed-finetune[keynorm]")["per_seed"].values())
    verdicts = {(t, c["b"]): c["verdict"] for t, r in fresh.items() for c in r["comparisons"]}
    assert verdicts[("lookahead", "dms[tuned]")] == verdicts[("kvtrace", "fixed-finetune[keynorm]")] == "b better"


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

"""``kvpop eval --problems``: accuracy of generated answers per policy and budget (kvpop.answers)."""
import json

import pytest
import torch
from test_cli_train import _tokenizer_model_dir

from kvpop import answers as P
from kvpop.answers import generation as G
from kvpop.cli import main
from kvpop.demo import lookahead_task as LT
from kvpop.demo import task as T
from kvpop.demo.problems import task_problems, write_task_problems
from kvpop.evaluation import evaluate as E

SINKS, WINDOW = 4, 32


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.set_num_threads(1)


def _problems(recs):
    return [P.Problem(i, r["id"], r["prompt_ids"], None, r["answer_ids"]) for i, r in enumerate(recs)]


# ---------------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize("text,rule,want", [
    ("so 3 + 4 = 7, and the answer is 1,234.", "last-number", "1234"),
    ("x = -0.50 then 12.0", "last-number", "12"),
    ("negative: -7", "last-number", "-7"),
    ("no digits here", "last-number", None),
    (r"first \boxed{2} then \boxed{\frac{1}{2}} done", "boxed", r"\frac{1}{2}"),
    (r"\boxed{ 42 } and an unclosed \boxed{9", "boxed", "42"),
    ("nothing boxed", "boxed", None),
    ("Answer: 17\nAnswer: 19", r"regex:Answer:\s*(\d+)", "19"),
    ("ans=abc", r"regex:ans=\w+", "ans=abc"),
    ("no match", r"regex:Answer: (\d+)", None),
    ("  Paris \n", "exact", "Paris"),
])
def test_extraction_rules(text, rule, want):
    assert P.extract(text, rule) == want


def test_answers_compare_by_rule():
    assert P.is_correct(P.extract("it is 1,000.0", "last-number"), ["1000"], "last-number")
    assert P.is_correct(P.extract("it is 3.50", "last-number"), ["x", "3.5"], "last-number")
    assert not P.is_correct(P.extract("it is 35", "last-number"), ["3.5"], "last-number")
    assert P.is_correct(P.extract(r"\boxed{x + 1}", "boxed"), ["x+1"], "boxed")
    assert not P.is_correct(None, ["1"], "exact")
    with pytest.raises(ValueError, match="--extract must be one of"):
        P.check_rule("first-number")
    with pytest.raises(ValueError, match="does not compile"):
        P.check_rule("regex:(")


def test_pass_and_majority_arithmetic():
    m = P.sample_metrics(["4", "5", "4", None], [True, False, True, False])
    assert m == {"pass@1": 0.5, "pass@4": True, "maj@4": True}
    m = P.sample_metrics(["5", "4", "5", "4"], [False, True, False, True])  # tie: the first seen (5) wins
    assert m == {"pass@1": 0.5, "pass@4": True, "maj@4": False}
    m = P.sample_metrics([None, None, "4"], [False, False, True])  # no answer never wins the vote
    assert m["maj@3"] and m["pass@1"] == pytest.approx(1 / 3)
    m = P.sample_metrics(["1", "2"], [False, False])
    assert m == {"pass@1": 0.0, "pass@2": False, "maj@2": False}
    # a table's figures are the means over problems
    rows = {P.row_key("dense", None, i): {"pass@1": a, "pass@N": b, "maj@N": c, "mean_length": n, "peak_cache_bytes": 8}
            for i, (a, b, c, n) in enumerate([(0.5, True, True, 2.0), (0.0, False, False, 4.0)])}
    cfg = P.ProblemsConfig(budgets=[64], policies=["dense"], samples=4, progress=False)
    res = P.results_dict(rows, [P.Problem(i, str(i), [1], None, [2]) for i in range(2)], [("dense", None)], cfg)
    r = res["rows"][0]
    assert (r["pass@1"], r["maj@4"], r["pass@4"], r["mean_length"]) == (0.25, 0.5, 0.5, 3.0)


# ---------------------------------------------------------------------------------------- exact accuracy
@pytest.mark.parametrize("task", [T, LT])
def test_greedy_generation_equals_teacher_forced_reads(task):
    """Greedy dense (and streaming) generation of one token at every read gives exactly the teacher-forced
    read accuracy of the same reads (kvpop.evaluation.evaluate.sequence_correct)."""
    L, n, budget = (160, 2, 48) if task is T else (256, 1, 64)
    base = E.load_base_model(task.SHIPPED_MODEL)
    stream = E.policy_model(base, "streaming", sinks=SINKS, window=WINDOW, budget=budget)
    recs = task_problems(task.NAME, L, n)
    assert recs and all(len(r["answer_ids"]) == 1 for r in recs)
    cfg = P.ProblemsConfig(budgets=[budget], policies=["dense", "streaming"], max_new_tokens=1, batch_size=5,
                           sinks=SINKS, window=WINDOW, progress=False)
    res = P.evaluate_problems({"dense": base, "streaming": stream}, _problems(recs), cfg, eos_token_id=None)
    for policy in ("dense", "streaming"):
        correct = graded = 0
        for i in range(n):
            ex = task.make_example(task.test_seed(i), L, task.DEFAULT)
            c, g = E.sequence_correct(base if policy == "dense" else stream, ex, policy,
                                      None if policy == "dense" else budget)
            correct, graded = correct + c, graded + g
        row = next(r for r in res["rows"] if r["policy"] == policy)
        assert graded == len(recs) and row["problems"] == graded
        assert row["pass@1"] == correct / graded, policy
        assert row["mean_length"] == 1.0
    dense = next(r for r in res["rows"] if r["policy"] == "dense")
    assert dense["pass@1"] > 0.9  # the shipped models answer their reads


# ---------------------------------------------------------------------------------------- resume
def _cli(tmp_path, data, out, *extra):
    return main(["eval", "--problems", str(data), "--policies", "dense,streaming", "--budgets", "48",
                 "--samples", "3", "--temperature", "1.0", "--top-p", "0.9", "--seed", "5", "--max-new-tokens", "2",
                 "--batch-size", "4", "--out", str(out), "--no-progress", *extra])


def test_resume_after_an_interrupt_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    data = tmp_path / "kv.jsonl"
    recs = task_problems("kvtrace", 96, 1, reads=5)
    with open(data, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    assert _cli(tmp_path, data, tmp_path / "full", "--no-plot") == 0
    full = (tmp_path / "full" / "results.json").read_text()
    gens_full = (tmp_path / "full" / "generations.jsonl").read_text()

    real = G.generate_rows
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(G, "generate_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _cli(tmp_path, data, tmp_path / "part", "--no-plot")
    log = (tmp_path / "part" / "problems.jsonl").read_text().splitlines()
    assert 0 < len(log) < 10  # some problems were logged before the interrupt
    with open(tmp_path / "part" / "problems.jsonl", "a") as f:
        f.write('{"policy": "streaming", "bud')  # a line torn by the interrupt
    monkeypatch.setattr(G, "generate_rows", real)
    assert _cli(tmp_path, data, tmp_path / "part") != 0  # without --resume the earlier run is not overwritten
    assert (tmp_path / "part" / "problems.jsonl").read_text().splitlines()[:len(log)] == log
    assert _cli(tmp_path, data, tmp_path / "part", "--resume", "--no-plot") == 0
    lines = (tmp_path / "part" / "problems.jsonl").read_text().splitlines()
    assert lines[:len(log)] == log and len(lines) == 10  # nothing repeated, nothing lost
    assert (tmp_path / "part" / "results.json").read_text() == full
    assert sorted(gens_full.splitlines()) == sorted((tmp_path / "part" / "generations.jsonl").read_text().splitlines())
    res = json.loads(full)
    assert [r["policy"] for r in res["rows"]] == ["dense", "streaming"] and res["n_problems"] == 5
    assert {"pass@1", "maj@3", "pass@3", "mean_length", "peak_cache_bytes_per_sequence"} <= set(res["rows"][0])
    # another sampling setting is refused on resume, naming it
    assert main(["eval", "--problems", str(data), "--policies", "dense,streaming", "--budgets", "48", "--samples", "3",
                 "--temperature", "0.5", "--top-p", "0.9", "--seed", "5", "--max-new-tokens", "2", "--out",
                 str(tmp_path / "part"), "--resume", "--no-progress"]) == 2
    (tmp_path / "part" / "settings.json").unlink()  # a log whose settings are unknown is not continued
    assert _cli(tmp_path, data, tmp_path / "part", "--resume") == 2
    assert (tmp_path / "part" / "problems.jsonl").read_text().splitlines() == lines


def test_sampled_rows_do_not_depend_on_their_batch(tmp_path):
    base = E.load_base_model()
    recs = task_problems("kvtrace", 96, 1, reads=3)
    kw = dict(budgets=[48], policies=["dense"], samples=2, temperature=1.0, seed=3, max_new_tokens=3,
              sinks=SINKS, window=WINDOW, progress=False)
    logs = []
    for bs in (1, 6):
        cfg = P.ProblemsConfig(batch_size=bs, **kw)
        P.evaluate_problems({"dense": base}, _problems(recs), cfg, out=tmp_path / str(bs))
        logs.append([json.loads(x) for x in (tmp_path / str(bs) / "problems.jsonl").open()])
    assert logs[0] == logs[1]
    toks = [s["tokens"] for row in logs[0] for s in row["samples"]]
    assert len(toks) == 6 and len({tuple(t) for t in toks}) > 1  # sampled: not all the same


# ---------------------------------------------------------------------------------------- text problems
def test_text_problems_with_a_tokenizer(tmp_path):
    mdir = _tokenizer_model_dir(tmp_path / "model")
    data = tmp_path / "text.jsonl"
    with open(data, "w") as f:
        f.write(json.dumps({"id": "a", "prompt": "w1 w2 w3 w4 w5", "answer": ["w6", "w7"]}) + "\n")
        f.write(json.dumps({"prompt": " ".join(f"w{i}" for i in range(60)), "answer": "w9"}) + "\n")
    out = tmp_path / "out"
    assert main(["eval", "--model", str(mdir), "--problems", str(data), "--policies", "dense,streaming",
                 "--budgets", "40", "--extract", "regex:(w\\d+)", "--max-new-tokens", "3", "--out", str(out),
                 "--no-progress", "--no-plot"]) == 0
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 4 and {g["id"] for g in gens} == {"a", "1"}
    for g in gens:
        assert isinstance(g["text"], str) and 1 <= g["length"] <= 3
    res = json.loads((out / "results.json").read_text())
    assert [r["budget"] for r in res["rows"]] == [None, 40]


# ---------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("line,match", [
    ('{"prompt_ids": [1, 2, 3]}', r"p.jsonl:2: expected exactly one of \"answer\""),
    ('{"id": "q7", "prompt_ids": [1, 2], "answer": ""}', r"p.jsonl:2 \(id 'q7'\): \"answer\" must be a non-empty"),
    ('{"prompt_ids": [1, 2], "answer": []}', r"\"answer\" must be a non-empty"),
    ('{"prompt_ids": [1, 2], "answer_ids": []}', r"p.jsonl:2: \"answer_ids\" is empty"),
    ('{"prompt_ids": [1, 640], "answer_ids": [5]}', r"\"prompt_ids\" holds token id 640, outside .*\[0, 640\)"),
    ('{"prompt_ids": [1, 2], "answer_ids": [-1]}', r"\"answer_ids\" holds token id -1"),
    ('{"prompt": "what is 2+2?", "answer": "4"}', r"p.jsonl:2: a text \"prompt\" needs a tokenizer"),
    ('{"prompt_ids": [1, 2], "answer": "4"}', r"a text \"answer\" .* no tokenizer"),
    ('{"prompt_ids": [1, 2], "answer_ids": [3], "id": "0"}', r"\"id\" '0' is also the id of the record on line 1"),
    ('[1, 2]', r"p.jsonl:2: expected a JSON object"),
    ('{"prompt_ids": [1, 2', r"p.jsonl:2: not valid JSON"),
])
def test_bad_records_name_the_line_and_field(tmp_path, capsys, line, match):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt_ids": [1, 2, 3], "answer_ids": [4]}\n' + line + "\n")
    assert main(["eval", "--problems", str(data), "--policies", "dense", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "kvpop eval: error:" in err
    import re
    assert re.search(match, err), err


def test_other_usage_errors(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    data.write_bytes(b'{"prompt_ids": [1, 2, 3], "answer_ids": [4]}\n{"prompt_ids": [1], "answer_ids": [\xff]}\n')
    assert main(["eval", "--problems", str(data), "--policies", "dense", "--no-progress"]) == 2
    assert "p.jsonl:2: not UTF-8 (byte 0xff" in capsys.readouterr().err
    write_task_problems(data, "kvtrace", 96, 1, reads=1)
    for args, match in [(["--budgets", "36"], "budget(s) [36] too small: every budget must be >= sinks + window + 1"),
                        (["--extract", "first"], "--extract must be one of"),
                        (["--samples", "0"], "--samples must be an int >= 1"),
                        (["--top-p", "0"], "--top-p must be in (0, 1]"),
                        (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
                        (["--resume"], "--resume needs --out"),
                        (["--lengths", "128"], "--lengths is not for --problems")]:
        assert main(["eval", "--problems", str(data), "--policies", "dense,streaming", "--no-progress", *args]) == 2
        assert match in capsys.readouterr().err, args


# ---------------------------------------------------------------------------------------- every policy
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 1-step ``kvpop train --out`` directory per trained method (sinks 2, window 8), on the shipped model."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    data = root / "train.jsonl"
    with open(data, "w") as f:
        for i in range(2):
            f.write(json.dumps({"input_ids": T.make_example(T.train_seed(i), 64)["input_ids"].tolist()}) + "\n")
    common = ["train", "--data", str(data), "--seq-len", "64", "--sinks", "2", "--window", "8", "--steps", "1",
              "--no-progress"]
    for name, extra in {"mlp": ["--budget", "16", "--scorer", "mlp", "--no-train-model"],
                        "mlp-joint": ["--budget", "16", "--scorer", "mlp"],
                        "mlstm-joint": ["--budget", "16", "--scorer", "mlstm"],
                        "fixed": ["--budget", "16", "--mask-source", "streaming"],
                        "dms": ["--method", "dms", "--target-keep", "0.25"]}.items():
        assert main([*common, *extra, "--out", str(root / name)]) == 0
    return root


def test_every_policy_generates_and_matches_its_teacher_forced_reads(runs, tmp_path):
    """All ten policies answer through their caches; greedy one-token answers of every fixed-budget policy
    equal its teacher-forced reads (kvpop.evaluation.evaluate.sequence_correct at the same budget)."""
    L, budget = 96, 16
    data = tmp_path / "kv.jsonl"
    write_task_problems(data, "kvtrace", L, 1, reads=4)
    out = tmp_path / "out"
    specs = {"kvpop-mlp": "mlp", "kvpop-mlp-joint": "mlp-joint", "kvpop-mlstm": "mlstm-joint",
             "kvpop-mlstm-joint": "mlstm-joint", "fixed-finetune": "fixed", "dms": "dms"}
    given = [a for p, d in specs.items() for a in ("--run", f"{p}={runs / d}")]
    assert main(["eval", "--problems", str(data), *given, "--budgets", str(budget), "--max-new-tokens", "1",
                 "--batch-size", "3", "--out", str(out), "--no-progress", "--no-plot"]) == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["policy"]: r for r in res["rows"]}
    assert list(rows) == [p for p in E.POLICIES if p in specs or p in ("dense", "streaming", "tova", "h2o")]
    ex = T.make_example(T.test_seed(0), L)
    n = min(4, ex["answers"].numel())
    ex = {**ex, "answer_positions": ex["answer_positions"].reshape(-1)[:n], "answers": ex["answers"].reshape(-1)[:n]}
    from kvpop.cli.trained import read_run

    base = E.load_base_model()
    for policy in rows:
        if policy == "dms":  # its threshold is set on the prompt here, on the validation sequences there
            continue
        t = read_run(f"{policy}={runs / specs[policy]}") if policy in specs else None
        ft = E.load_base_model(t.model) if t is not None and t.model is not None else None
        m = E.policy_model(base, policy, scorers=t.scorers if t else None, finetuned=ft, sinks=2, window=8,
                           budget=budget)
        pred = E.sequence_predictions(m, ex, policy, None if policy == "dense" else budget)
        want = (pred == ex["answers"]).float().tolist()
        got = [r["pass@1"] for r in res["per_problem"] if r["policy"] == policy]
        assert got == want, policy  # problem by problem
    assert rows["dms"]["peak_cache_bytes_per_sequence"] > 0
    assert rows["kvpop-mlp"]["peak_cache_bytes_per_sequence"] < rows["dense"]["peak_cache_bytes_per_sequence"]


def test_vllm_engine_errors(tmp_path, capsys):
    data = tmp_path / "p.jsonl"
    write_task_problems(data, "kvtrace", 96, 1, reads=1)
    assert main(["eval", "--problems", str(data), "--engine", "vllm", "--policies", "dense,tova,dms",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm serves" in err and "not ['tova', 'dms']" in err
    assert main(["eval", "--problems", str(data), "--policies", "dense,dms-test-calibrated", "--no-progress"]) == 2
    assert "dms-test-calibrated is not a --problems policy" in capsys.readouterr().err
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert main(["eval", "--problems", str(data), "--engine", "vllm", "--policies", "dense", "--no-progress"]) == 2
        assert "--engine vllm needs vLLM installed" in capsys.readouterr().err


def test_the_task_problems_command_writes_the_file_and_refuses_a_bad_length(tmp_path, capsys):
    from kvpop.cli.task_problems import main as task_problems_main

    out = tmp_path / "p.jsonl"
    assert task_problems_main(["--task", "kvtrace", "--length", "128", "--n-sequences", "1", "--reads", "2",
                               "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and f"wrote 2 problems to {out}" in capsys.readouterr().out
    assert task_problems_main(["--task", "kvtrace", "--length", "8", "--out", str(out)]) == 2
    assert "error" in capsys.readouterr().err

"""``kvpop train`` end to end, its data loading and errors, and FSDP2 / DDP with 2 gloo processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop.cli import main  # noqa: E402
from kvpop.training.data import chunk, make_batches, read_jsonl  # noqa: E402
from kvpop.training.train import TrainConfig, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# the tiny model (--tiny: 2 layers, vocab 640) at S = 48 > budget 24: 24 decisions per head and layer
FAST = ["--seq-len", "48", "--budget", "24", "--sinks", "2", "--window", "8", "--no-progress",
        "--lr-model", "1e-3", "--lr-scorer", "1e-2"]


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _write_ids(path, n=6, length=100, vocab=640, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": torch.randint(0, vocab, (length,), generator=g).tolist()}) + "\n")
    return path


def _history(out):
    return [json.loads(line) for line in (Path(out) / "history.jsonl").read_text().splitlines()]


def _scorer_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_token_ids_end_to_end(tmp_path):
    data = _write_ids(tmp_path / "tiny.jsonl")
    out = tmp_path / "run"
    assert main(["train", "--tiny", "--data", str(data), "--steps", "3", "--out", str(out), *FAST]) == 0
    hist = _history(out)
    assert [h["step"] for h in hist] == [1, 2, 3]
    assert all(h["kl"] > 0 and h["score"] > 0 for h in hist)
    for name in ("last.pt", "scorers.safetensors", "args.json", "model/config.json", "model/model.safetensors"):
        assert (out / name).exists(), name
    assert not list(out.glob("*.tmp"))
    from transformers import AutoModelForCausalLM

    # the fine-tuned model loads as a plain Qwen3 and the scorers load back onto it
    m = AutoModelForCausalLM.from_pretrained(str(out / "model"), local_files_only=True)
    assert type(m).__name__ == "Qwen3ForCausalLM"
    assert not kvpop.is_patched(m) and not any(".kvpop." in k for k in m.state_dict())
    kvpop.load_scorers(m, out / "scorers.safetensors")
    cfg = kvpop.get_config(m)
    assert (cfg.budget, cfg.sinks, cfg.window, cfg.scorer) == (24, 2, 8, "mlp")
    ck = torch.load(out / "last.pt", weights_only=False)
    assert ck["step"] == 3
    sd = m.state_dict()
    for k, v in ck["model"].items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)
    # the model moved away from the --tiny initialisation
    from kvpop.demo.pretrain import build_model

    init = build_model(seed=0).state_dict()
    assert not torch.equal(init["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.q_proj.weight"])


def _tokenizer_model_dir(path):
    """A model directory with a tiny word-level tokenizer built here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvpop.demo.pretrain import build_model

    words = ["[UNK]", "[EOS]"] + [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    build_model(seed=1).save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return path


def test_text_jsonl_uses_the_models_tokenizer(tmp_path):
    mdir = _tokenizer_model_dir(tmp_path / "model")
    data = tmp_path / "text.jsonl"
    with open(data, "w") as f:
        for r in range(4):
            f.write(json.dumps({"text": " ".join(f"w{(7 * r + 3 * i) % 200}" for i in range(60))}) + "\n")
        f.write("\n")  # blank lines are skipped
        f.write(json.dumps({"input_ids": list(range(2, 62))}) + "\n")  # kinds may be mixed
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(mdir), local_files_only=True)
    recs = read_jsonl(data, vocab_size=640, tokenizer=tok)
    assert len(recs) == 5 and recs[0][:3] == [2 + 0, 2 + 3, 2 + 6] and len(recs[0]) == 60
    assert recs[4] == list(range(2, 62))
    out = tmp_path / "run"
    assert main(["train", "--model", str(mdir), "--data", str(data), "--steps", "2", "--out", str(out),
                 "--batch-size", "2", *FAST]) == 0
    assert len(_history(out)) == 2 and (out / "model" / "model.safetensors").exists()
    # text data with a model that has no tokenizer: the shipped model, and --tiny
    with pytest.raises(SystemExit, match="holds no tokenizer"):
        main(["train", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "r2"), *FAST])
    with pytest.raises(SystemExit, match="--tiny has no tokenizer"):
        main(["train", "--tiny", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "r3"), *FAST])


def test_task_with_the_shipped_model_scorers_only(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--task", "--steps", "2", "--out", str(out), "--no-train-model",
            *[a for a in FAST if a != "--no-progress"]]
    args[args.index("--seq-len") + 1] = "64"
    assert main(args) == 0
    err = capsys.readouterr().err  # the progress report shows the losses
    assert "kvpop train" in err and "score=" in err and "kl=" in err and "acc=" in err
    # stderr is not a terminal here: plain lines (step 1 and 2 of 2), no bar redrawn with carriage returns
    assert "\r" not in err and "kvpop train: 2/2 (100%)" in err
    hist = _history(out)
    assert len(hist) == 2 and all(h["kl"] == 0.0 and h["score"] > 0 for h in hist)
    assert not (out / "model").exists()  # scorers only: the model is unchanged, not written
    from transformers import AutoModelForCausalLM

    from kvpop.demo.task import SHIPPED_MODEL  # what kvpop train --task loads without --model

    orig = AutoModelForCausalLM.from_pretrained(str(SHIPPED_MODEL), local_files_only=True).state_dict()
    ck = torch.load(out / "last.pt", weights_only=False)
    for k, v in orig.items():
        assert torch.equal(ck["model"][k], v), k
    m = kvpop.load_scorers(AutoModelForCausalLM.from_pretrained(str(SHIPPED_MODEL)), out / "scorers.safetensors")
    assert kvpop.get_config(m).budget == 24


def test_label_and_context_decay_reach_the_config(tmp_path, capsys):
    """--label, --label-power and --decay-nats (gamma_min = exp(-N / --seq-len)) end up in the scorers' config."""
    import math

    data = _write_ids(tmp_path / "tiny.jsonl")
    out = tmp_path / "run"
    assert main(["train", "--tiny", "--data", str(data), "--steps", "1", "--out", str(out), *FAST,
                 "--label", "power", "--label-power", "3", "--decay-nats", "4"]) == 0
    cfg = kvpop.read_scorer_config(out / "scorers.safetensors")
    seq_len = FAST[FAST.index("--seq-len") + 1]
    assert (cfg.label, cfg.label_power) == ("power", 3.0)
    assert math.isclose(cfg.gamma_min, math.exp(-4 / int(seq_len))) and cfg.gamma_init == 0.9999
    assert _err(tmp_path, "--tiny", "--data", str(data), "--label", "median") == "2"  # argparse's choices
    assert "invalid choice: 'median'" in capsys.readouterr().err
    assert "--label-power must lie in [0.01, 10000], got 0" in _err(tmp_path, "--tiny", "--data", str(data),
                                                                    "--label", "power", "--label-power", "0")
    assert "leave out --gamma-min" in _err(tmp_path, "--tiny", "--data", str(data), "--decay-nats", "4",
                                           "--gamma-min", "0.99")
    assert "gamma_min" in _err(tmp_path, "--tiny", "--data", str(data), "--decay-nats", "1e-9")


def test_method_knobs_reach_the_config(tmp_path):
    """--tie-margin, --eps, the decay range and the target source end up in the trained scorers' config."""
    data = _write_ids(tmp_path / "tiny.jsonl")
    out = tmp_path / "run"
    assert main(["train", "--tiny", "--data", str(data), "--steps", "1", "--out", str(out), *FAST,
                 "--tie-margin", "0.25", "--eps", "1e-4", "--gamma-min", "0.99", "--gamma-max", "0.9999",
                 "--gamma-init", "0.995", "--target-source", "teacher", "--loss-chunk", "7"]) == 0
    cfg = kvpop.read_scorer_config(out / "scorers.safetensors")
    assert (cfg.tie_margin, cfg.eps, cfg.gamma_min, cfg.gamma_max, cfg.gamma_init, cfg.target_source) == \
        (0.25, 1e-4, 0.99, 0.9999, 0.995, "teacher")
    h = _history(out)[0]
    assert h["kl"] > 0 and h["score"] > 0 and 0.99 <= h["gamma_min"] <= h["gamma_max"] <= 0.9999
    assert "gamma_min < gamma_max" in _err(tmp_path, "--tiny", "--data", str(data), "--gamma-min", "0.9999",
                                           "--gamma-max", "0.99")
    assert "tie_margin must be" in _err(tmp_path, "--tiny", "--data", str(data), "--tie-margin", "-1")
    assert "--loss-chunk must be >= 1" in _err(tmp_path, "--tiny", "--data", str(data), "--loss-chunk", "0")


def test_task_batches_are_lazy_and_distinct():
    from kvpop.demo import task as T
    from kvpop.demo.task import TaskBatches

    it = iter(TaskBatches(64, 2))
    b0, b1 = next(it), next(it)
    assert len(b1) == 0  # nothing generated before it is read
    assert b0["input_ids"].shape == (2, 64)
    torch.testing.assert_close(b1["input_ids"][1], T.make_example(T.train_seed(3), 64)["input_ids"])


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    data = _write_ids(tmp_path / "d.jsonl", n=8)
    common = ["--tiny", "--data", str(data), "--grad-accum", "2", "--warmup-steps", "2", "--checkpoint-every", "1",
              *FAST]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", *common, "--steps", "4", "--out", str(full)]) == 0
    assert main(["train", *common, "--steps", "2", "--out", str(part)]) == 0
    assert main(["train", *common, "--steps", "4", "--out", str(part), "--resume"]) == 0
    h_full, h_part = _history(full), _history(part)
    assert [h["step"] for h in h_part] == [1, 2, 3, 4]
    for a, b in zip(h_full, h_part):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5) and a["score"] == pytest.approx(b["score"], rel=1e-5)
    sa, sb = _scorer_tensors(full / "scorers.safetensors"), _scorer_tensors(part / "scorers.safetensors")
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=1e-5, msg=k)
    ma = torch.load(full / "last.pt", weights_only=False)["model"]
    mb = torch.load(part / "last.pt", weights_only=False)["model"]
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], atol=1e-6, rtol=1e-5, msg=k)
    # nothing left to do
    assert main(["train", *common, "--steps", "4", "--out", str(part), "--resume"]) == 0
    # a changed argument is refused
    with pytest.raises(SystemExit, match="--lr-scorer"):
        main(["train", *common, "--steps", "5", "--out", str(part), "--resume", "--lr-scorer", "0.5"])


@pytest.mark.gpu
def test_bf16_on_cuda(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--tiny", "--task", "--bf16", "--device", "cuda", "--steps", "3", "--out", str(out), *FAST]
    args[args.index("--seq-len") + 1] = "128"
    assert main(args) == 0
    hist = _history(out)
    assert len(hist) == 3 and all(0 < h["kl"] < 10 and 0 < h["score"] < 10 for h in hist)
    ck = torch.load(out / "last.pt", weights_only=False)
    assert all(v.dtype == torch.float32 for k, v in ck["model"].items() if v.is_floating_point())


def _err(tmp_path, *args):
    base = ["train", "--out", str(tmp_path / "err"), "--steps", "1", *FAST]
    with pytest.raises(SystemExit) as e:
        main([*base, *args])
    return str(e.value.code)


def test_user_errors(tmp_path):
    good = _write_ids(tmp_path / "good.jsonl")
    assert "--data FILE.jsonl or --task" in _err(tmp_path, "--tiny")
    assert "does not exist" in _err(tmp_path, "--tiny", "--data", str(tmp_path / "missing.jsonl"))
    assert "no such directory" in _err(tmp_path, "--model", str(tmp_path / "nomodel"), "--data", str(good))
    (tmp_path / "empty_model").mkdir()
    assert "no config.json" in _err(tmp_path, "--model", str(tmp_path / "empty_model"), "--data", str(good))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2,\n')
    assert f"{bad}:2: not valid JSON" in _err(tmp_path, "--tiny", "--data", str(bad))
    bad.write_text('{"input_ids": [1, 2, 3]}\n\n{"tokens": [1]}\n')
    assert f"{bad}:3: expected an object" in _err(tmp_path, "--tiny", "--data", str(bad))
    bad.write_text('{"input_ids": [1, "a"]}\n')
    assert f"{bad}:1: \"input_ids\" must be a list of ints" in _err(tmp_path, "--tiny", "--data", str(bad))
    bad.write_text('{"input_ids": [1, 640]}\n')
    assert "token id 640 is outside the model's vocabulary [0, 640)" in _err(tmp_path, "--tiny", "--data", str(bad))
    bad.write_text("")
    assert "holds no records" in _err(tmp_path, "--tiny", "--data", str(bad))

    short = _write_ids(tmp_path / "short.jsonl", n=3, length=40)
    msg = _err(tmp_path, "--tiny", "--data", str(short))
    assert "longest record has 40 tokens" in msg and "--pack" in msg
    assert "fewer than --batch-size 4" in _err(tmp_path, "--tiny", "--data", str(short), "--pack", "--batch-size", "4")
    assert "must be larger than --budget" in _err(tmp_path, "--tiny", "--data", str(good), "--budget", "48")
    assert "budget=12 leaves no long-range slot" in _err(tmp_path, "--tiny", "--data", str(good), "--budget", "12",
                                                         "--window", "10")
    assert "--bf16 needs a CUDA device" in _err(tmp_path, "--tiny", "--data", str(good), "--bf16", "--device", "cpu")
    assert "--steps must be >= 1" in _err(tmp_path, "--tiny", "--data", str(good), "--steps", "0")
    assert "--task needs --seq-len >= 64" in _err(tmp_path, "--tiny", "--task", "--seq-len", "40")
    assert "nothing to resume" in _err(tmp_path, "--tiny", "--data", str(good), "--resume")
    out = tmp_path / "taken"
    assert main(["train", "--tiny", "--data", str(good), "--steps", "1", "--out", str(out), *FAST]) == 0
    with pytest.raises(SystemExit, match="already holds a run"):
        main(["train", "--tiny", "--data", str(good), "--steps", "1", "--out", str(out), *FAST])
    with pytest.raises(ValueError, match="dist must be one of"):
        TrainConfig(dist="zero")


def test_chunk_and_batches():
    recs = [list(range(10)), list(range(100, 125))]
    seqs = chunk(recs, 8)
    assert [s.tolist() for s in seqs] == [list(range(8)), list(range(100, 108)), list(range(108, 116)),
                                          list(range(116, 124))]
    packed = chunk(recs, 12, pack=True, sep_id=2)
    assert packed[0].tolist() == list(range(10)) + [2, 100] and len(packed) == 3
    b = make_batches(seqs, 3, seed=0)
    assert len(b) == 1 and b[0].shape == (3, 8)


# --------------------------------------------------------------------------- several processes
def _fsdp_setup():
    m = tiny_model()
    teacher = kvpop.make_teacher(m)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    torch.manual_seed(11)
    kvpop.patch(m, balance=False, **SMALL)
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, 128, (1, 48), generator=g) for _ in range(2)]
    return m, teacher, data


_CFG = dict(lr_model=1e-3, lr_scorer=1e-2, warmup_steps=1, progress=False)


def _fsdp_steps(rank, out_dir):
    from kvpop.training.train import save_model

    # two steps with a checkpoint, then a fresh sharded model resumes for the third
    m, teacher, data = _fsdp_setup()
    h1 = train(m, data, TrainConfig(steps=2, dist="fsdp", checkpoint_dir=out_dir, checkpoint_every=1,
                                    activation_checkpointing=True, **_CFG), teacher=teacher)
    assert type(m).__name__.startswith("FSDP")
    m, teacher, data = _fsdp_setup()
    h2 = train(m, data, TrainConfig(steps=3, dist="fsdp", checkpoint_dir=out_dir, **_CFG), teacher=teacher,
               resume=True)
    save_model(m, os.path.join(out_dir, "model"))
    if rank == 0:
        torch.save(h1 + h2, os.path.join(out_dir, "hist.pt"))


def _fsdp_worker(rank, world, init_file, out_dir):
    import gc

    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _fsdp_steps(rank, out_dir)  # the sharded models are freed on return, before the group is left
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def test_fsdp_two_gloo_processes_match_one_process(tmp_path):
    """FSDP2 on 2 gloo ranks (one batch each; activation checkpointing in the first two steps), with a
    checkpoint and a resume in between, takes the steps of one process on both batches: the same
    losses, scorers and model weights."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    hist = torch.load(tmp_path / "hist.pt")
    assert [h["step"] for h in hist] == [1, 2, 3]
    ck = torch.load(tmp_path / "last.pt", weights_only=False)
    assert ck["step"] == 3 and "optimizer_fqn" in ck and ck["world_size"] == 2
    m, teacher, data = _fsdp_setup()
    ref = train(m, [torch.cat(data, dim=0)], TrainConfig(steps=3, **_CFG), teacher=teacher)
    for a, b in zip(hist, ref):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4) and a["score"] == pytest.approx(b["score"], rel=1e-4)
    sd = m.state_dict()
    for k, v in ck["model"].items():  # the full state dict gathered on rank 0 has the plain model's keys
        torch.testing.assert_close(v, sd[k], atol=2e-5, rtol=1e-4, msg=k)
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), local_files_only=True)
    assert type(saved).__name__ == "Qwen3ForCausalLM"
    kvpop.load_scorers(saved, tmp_path / "scorers.safetensors")
    for k, v in saved.state_dict().items():
        torch.testing.assert_close(v, sd[k], atol=2e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_torchrun_two_processes_match_one_process(tmp_path, mode):
    """``torchrun --nproc_per_node 2 -m kvpop train --dist MODE`` with batch 1 per process equals one
    process with batch 2."""
    data = _write_ids(tmp_path / "d.jsonl", n=4, length=48)
    args = ["--tiny", "--data", str(data), "--steps", "2", "--no-balance", *FAST]
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    two = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(Path(__file__).with_name("torchrun_probe.py")), "train", *args, "--dist", mode,
                        "--out", str(two)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the wrapped model is freed before the group is left, on both ranks (not in the interpreter's finalisation)
    assert r.stderr.count("wrapped modules alive when the group is left: 0") == 2, r.stderr[-3000:]
    one = tmp_path / "one"
    assert main(["train", *args, "--batch-size", "2", "--out", str(one)]) == 0
    for a, b in zip(_history(two), _history(one)):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4) and a["score"] == pytest.approx(b["score"], rel=1e-4)
    from safetensors.torch import load_file

    for name in ("scorers.safetensors", "model/model.safetensors"):
        sa, sb = load_file(str(two / name)), load_file(str(one / name))
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], atol=2e-5, rtol=1e-4, msg=f"{name}:{k}")

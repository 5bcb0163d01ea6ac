"""Tests of the key-value trace task (kvpop.demo.task) and the shipped tiny model."""
from pathlib import Path

import pytest
import torch

from kvpop.demo import task as T

CFG = T.DEFAULT
LENGTHS = [64, 100, 128, 257, 512, 1024, 2048]


@pytest.mark.parametrize("length", LENGTHS)
def test_length_and_shapes(length):
    e = T.make_example(T.test_seed(3), length)
    assert e["input_ids"].shape == (length,)
    assert e["input_ids"].dtype == torch.int64
    assert e["labels"].shape == (length,)
    n = CFG.n_reads_for(length)
    assert e["answer_positions"].shape == (n,)
    assert e["answers"].shape == (n,)
    assert e["fact_positions"].shape == (CFG.n_facts_for(length),)
    assert e["input_ids"][0].item() == T.BOS_ID
    assert int(e["input_ids"].max()) < CFG.vocab_size
    assert int(e["input_ids"].min()) >= 0
    assert int(e["answer_positions"].max()) + 1 < length
    # increasing, so reads never overlap
    assert bool((e["answer_positions"].diff() >= 2).all())


def test_lengths_scale_up_to_caps():
    assert CFG.n_facts_for(2048) == CFG.max_facts
    assert CFG.n_facts_for(1024) == CFG.max_facts
    assert CFG.n_reads_for(2048) == 2 * CFG.n_reads_for(1024)
    assert CFG.n_facts_for(128) < CFG.max_facts


@pytest.mark.parametrize("length", [128, 1024])
def test_deterministic_by_seed(length):
    a = T.make_example(7, length)
    b = T.make_example(7, length)
    c = T.make_example(8, length)
    for k in ("input_ids", "answer_positions", "answers", "fact_positions", "labels"):
        assert torch.equal(a[k], b[k])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    # different lengths give independent examples, not prefixes of one another
    d = T.make_example(7, 2 * length)
    assert not torch.equal(d["input_ids"][:length], a["input_ids"])


def test_train_test_seeds_disjoint():
    train = {T.train_seed(i) for i in range(0, 10_000_000, 997)} | {T.train_seed(10**12 + 5)}
    test = {T.test_seed(i) for i in range(0, 1000)}
    assert max(train) < T.TEST_SEED_BASE <= min(test)
    assert not train & test


@pytest.mark.parametrize("length", [64, 256, 1024, 2048])
@pytest.mark.parametrize("seed", [0, 1, T.test_seed(0), T.test_seed(11)])
def test_answers_derivable_from_sequence(length, seed):
    """Each graded position holds KEY(k); the next token is the VALUE of the unique earlier FACT(k, .)."""
    e = T.make_example(seed, length)
    ids = e["input_ids"]
    facts = {}
    for p in range(length):
        t = int(ids[p])
        if CFG.fact_base <= t < CFG.filler_base:
            k, v = divmod(t - CFG.fact_base, CFG.n_values)
            assert k not in facts, "each key is written at most once"
            facts[k] = (v, p)
    assert len(facts) == CFG.n_facts_for(length)
    assert sorted(p for _, p in facts.values()) == e["fact_positions"].tolist()
    assert min(facts_p for _, facts_p in facts.values()) >= 8  # sinks hold no fact
    for i, p in enumerate(e["answer_positions"].tolist()):
        key_tok = int(ids[p])
        assert CFG.key_base <= key_tok < CFG.value_base
        k = key_tok - CFG.key_base
        assert k in facts
        v, fp = facts[k]
        assert int(ids[p + 1]) == CFG.value_id(v) == int(e["answers"][i])
        assert int(e["labels"][p + 1]) == int(ids[p + 1])
        assert fp == int(e["read_fact_positions"][i])
        assert p - fp >= int((CFG.read_frac - CFG.fact_frac) * length) - 1  # read far from its fact
    # KEY and VALUE tokens appear only in reads; labels only at answers
    is_kv = (ids >= CFG.key_base) & (ids < CFG.fact_base)
    assert int(is_kv.sum()) == 2 * len(e["answer_positions"])
    assert int((e["labels"] != -100).sum()) == len(e["answer_positions"])


def test_batch_stacks():
    b = T.make_batch([T.test_seed(i) for i in range(3)], 256)
    assert b["input_ids"].shape == (3, 256)
    assert b["answer_positions"].shape == (3, CFG.n_reads_for(256))
    e1 = T.make_example(T.test_seed(1), 256)
    assert torch.equal(b["input_ids"][1], e1["input_ids"])


def _onehot_logits(ids, positions, targets, vocab):
    logits = torch.zeros(ids.shape[0], vocab)
    logits[torch.arange(ids.shape[0]), (ids + 5) % vocab] = 1.0  # wrong everywhere
    logits[positions, targets] = 2.0
    return logits


def test_accuracy_hand_made():
    e = T.make_example(T.test_seed(2), 256)
    pos, ans = e["answer_positions"], e["answers"]
    V = CFG.vocab_size
    perfect = _onehot_logits(e["input_ids"], pos, ans, V)
    assert T.accuracy(perfect, e) == 1.0
    wrong = _onehot_logits(e["input_ids"], pos, (ans + 1) % V, V)
    assert T.accuracy(wrong, e) == 0.0
    # exactly 3 of n right
    n = len(pos)
    half = (ans + 1) % V
    half[:3] = ans[:3]
    assert T.accuracy(_onehot_logits(e["input_ids"], pos, half, V), e) == pytest.approx(3 / n)
    # ungraded positions do not matter
    perfect2 = perfect.clone()
    mask = torch.ones(256, dtype=torch.bool)
    mask[pos] = False
    perfect2[mask] = torch.randn(int(mask.sum()), V) * 10
    assert T.accuracy(perfect2, e) == 1.0
    # batched form: [B, L, V]
    b = T.make_batch([T.test_seed(2), T.test_seed(3)], 256)
    lg = torch.stack([perfect, _onehot_logits(b["input_ids"][1], b["answer_positions"][1],
                                              (b["answers"][1] + 1) % V, V)])
    assert T.accuracy(lg, b) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        T.accuracy(torch.zeros(V), e)


def test_bad_arguments():
    with pytest.raises(ValueError):
        T.make_example(0, 10)
    with pytest.raises(ValueError):
        T.make_example(-1, 128)
    with pytest.raises(TypeError):
        T.make_example(0, 128.0)


MODEL_DIR = Path(__file__).resolve().parents[2] / "kvpop" / "data" / "tiny_qwen3"


@pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(),
                    reason="shipped tiny model not present yet")
def test_shipped_model_solves_short_examples():
    from transformers import Qwen3ForCausalLM

    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
    model = Qwen3ForCausalLM.from_pretrained(MODEL_DIR).eval()
    cfg = model.config
    assert cfg.head_dim >= 32
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
    assert cfg.vocab_size == CFG.vocab_size
    b = T.make_batch([T.test_seed(i) for i in range(4)], 512)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"]).logits
    assert T.accuracy(logits, b) >= 0.9


def test_pretrain_resume_is_exact(tmp_path):
    """Stopping after a checkpoint and resuming gives the same weights as one uninterrupted run."""
    from kvpop.cli import pretrain

    common = ["--steps", "6", "--eval-every", "3", "--ckpt-every", "100", "--curriculum",
              "64:4,128:2", "--min-stage-steps", "2", "--advance-acc", "0.0", "--eval-n", "2",
              "--hidden", "64", "--intermediate", "64", "--no-progress"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert pretrain.main(["--out", str(a), *common]) == 0
    assert pretrain.main(["--out", str(b), *common, "--max-minutes", "0"]) == 0  # stops after 1 step
    ck = torch.load(b / "ckpt.pt", weights_only=False)
    assert 1 <= ck["state"]["step"] < 6
    assert pretrain.main(["--out", str(b), *common, "--resume"]) == 0
    wa = torch.load(a / "ckpt.pt", weights_only=False)
    wb = torch.load(b / "ckpt.pt", weights_only=False)
    assert wa["state"]["step"] == wb["state"]["step"] == 6
    assert wa["state"]["stage"] == wb["state"]["stage"] == 1
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    assert (a / "model" / "model.safetensors").exists()


def test_parse_curriculum():
    from kvpop.demo.pretrain import parse_curriculum

    assert parse_curriculum("128:64,256:32") == [(128, 64), (256, 32)]
    with pytest.raises(ValueError):
        parse_curriculum("128-64")


def test_pretrain_settings_match_the_command():
    """kvpop pretrain's options are PretrainSettings's fields, in its order and with its defaults (what args.json
    and the checkpoints record)."""
    from dataclasses import asdict

    from kvpop.cli.pretrain import build_parser
    from kvpop.demo.pretrain import PretrainSettings

    parsed = vars(build_parser().parse_args(["--out", "x"]))
    # the write rule's run-only options (kvpop.cli.writes) are kept out of the settings and args.json
    assert {k for k in parsed if k.startswith("_")} == {"_write_shipped", "_overwrite"}
    parsed = {k: v for k, v in parsed.items() if not k.startswith("_")}
    assert list(parsed) == list(asdict(PretrainSettings(out="x")))
    assert parsed == asdict(PretrainSettings(out="x"))
    with pytest.raises(TypeError):
        PretrainSettings(out="x", not_an_option=1)

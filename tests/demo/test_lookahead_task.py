"""The lookahead trace task: a fact's importance is decided only by the marker after it."""
import collections

import pytest
import torch

from kvpop.demo import lookahead_task as T

CFG = T.DEFAULT
LENGTHS = [64, 100, 128, 257, 512, 1024, 2048]
WINDOW = 32  # the demo's window, which the block layout is built around


def _parse(ids):
    """Brute-force reading of a sequence: facts (pos, key, value), markers (pos, keep), reads (pos, key)."""
    facts, markers, reads = [], [], []
    ids = ids.tolist()
    for p, t in enumerate(ids):
        if CFG.fact_base <= t < CFG.keep_id:
            k, v = divmod(t - CFG.fact_base, CFG.n_values)
            facts.append((p, k, v))
        elif t in (CFG.keep_id, CFG.drop_id):
            markers.append((p, t == CFG.keep_id))
        elif CFG.key_base <= t < CFG.value_base:
            reads.append((p, t - CFG.key_base))
    return facts, markers, reads


@pytest.mark.parametrize("length", LENGTHS)
def test_shapes_and_ranges(length):
    e = T.make_example(T.test_seed(3), length)
    assert e["input_ids"].shape == (length,) and e["input_ids"].dtype == torch.int64
    assert e["input_ids"][0].item() == T.BOS_ID
    assert 0 <= int(e["input_ids"].min()) and int(e["input_ids"].max()) < CFG.vocab_size
    n = CFG.n_reads_for(length)
    assert e["answer_positions"].shape == e["answers"].shape == (n,)
    assert bool((e["answer_positions"].diff() >= 2).all())
    assert e["fact_positions"].shape == (CFG.n_blocks_for(length) * CFG.records_per_block(length),)
    assert CFG.records_per_block(length) == (CFG.block_records if length >= CFG.full_length else
                                             max(2, CFG.block_records * length // CFG.full_length))
    lab = e["labels"]
    assert torch.equal(lab[e["answer_positions"] + 1], e["answers"])
    assert int((lab != -100).sum()) == n


@pytest.mark.parametrize("length", [64, 256, 1024, 2048])
@pytest.mark.parametrize("seed", [0, 5, T.test_seed(0), T.valid_seed(2)])
def test_reads_ask_only_for_kept_facts_and_the_answer_is_unique(length, seed):
    e = T.make_example(seed, length)
    facts, markers, reads = _parse(e["input_ids"])
    keys = [k for _, k, _ in facts]
    assert len(keys) == len(set(keys))  # keys distinct: every answer is unique
    # each fact belongs to the first marker after it; that marker lies inside the window after it,
    # and the next marker lies beyond it
    mpos = [p for p, _ in markers]
    keep_of = {}
    for p, k, v in facts:
        after = [m for m in markers if m[0] > p]
        assert after and after[0][0] - p <= WINDOW - 1
        if len(after) > 1:
            assert after[1][0] - p > WINDOW
        keep_of[k] = (after[0][1], v)
    assert any(keep for keep, _ in keep_of.values())
    assert len(reads) == len(e["answers"])
    for (p, k), ans, ap in zip(reads, e["answers"].tolist(), e["answer_positions"].tolist()):
        assert p == ap and p > max(mpos)
        keep, v = keep_of[k]
        assert keep and ans == CFG.value_id(v)
    assert e["record_keep"].tolist() == [keep_of[k][0] for _, k, _ in facts]


def test_the_same_fact_ids_occur_kept_and_dropped():
    """Nothing in a fact token tells whether it will be read: every id shows up in both kinds of block."""
    seen = collections.defaultdict(set)
    for s in range(300):
        e = T.make_example(T.train_seed(s), 1024)
        ids = e["input_ids"][e["fact_positions"]].tolist()
        for t, keep in zip(ids, e["record_keep"].tolist()):
            seen[t].add(keep)
    both = sum(len(v) == 2 for v in seen.values())
    assert len(seen) > 0.9 * CFG.n_keys * CFG.n_values and both > 0.8 * len(seen)
    # every sequence keeps exactly round(keep_frac * n_blocks) blocks; which ones does not depend on position
    keeps = torch.stack([T.make_example(T.train_seed(s), 1024)["record_keep"].view(-1, CFG.block_records)[:, 0]
                         for s in range(300)]).float()  # [300, n_blocks]
    n_b = CFG.n_blocks_for(1024)
    assert keeps.shape == (300, n_b) and bool((keeps.sum(1) == CFG.n_keep_for(n_b)).all())
    assert CFG.n_keep_for(n_b) == max(1, round(CFG.keep_frac * n_b))
    assert float((keeps.mean(0) - CFG.keep_frac).abs().max()) < 0.1


def test_seeds_deterministic_and_splits_disjoint():
    a, b = T.make_example(7, 512), T.make_example(7, 512)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], T.make_example(8, 512)["input_ids"])
    train = {T.train_seed(i) for i in range(0, 10_000_000, 997)}
    test = {T.test_seed(i) for i in range(1000)}
    valid = {T.valid_seed(i) for i in range(1000)}
    assert max(train) < T.TEST_SEED_BASE <= min(test) and max(test) < T.VALID_SEED_BASE <= min(valid)


def test_batch_and_errors():
    b = T.make_batch([1, 2, 3], 256)
    assert b["input_ids"].shape == (3, 256) and b["record_keep"].shape[0] == 3
    with pytest.raises(ValueError, match="seeds is empty"):
        T.make_batch([], 256)
    with pytest.raises(ValueError, match=">= 64"):
        T.make_example(0, 63)
    with pytest.raises(TypeError, match="length must be an int"):
        T.make_example(0, 100.0)
    with pytest.raises(ValueError, match="non-negative"):
        T.make_example(-1, 100)
    with pytest.raises(ValueError, match="n_keys"):
        T.LookaheadConfig(n_keys=10)
    with pytest.raises(ValueError, match="block_period"):
        T.LookaheadConfig(block_period=5)
    with pytest.raises(ValueError, match="block_period"):
        T.LookaheadConfig(fact_gap=5)  # 6 facts 6 apart do not fit a period of 33
    with pytest.raises(ValueError, match="fact_gap"):
        T.LookaheadConfig(fact_gap=-1)
    with pytest.raises(ValueError, match="keep_frac"):
        T.LookaheadConfig(keep_frac=0.0)


@pytest.mark.parametrize("gap", [0, 1, 3])
def test_facts_of_a_block_are_fact_gap_apart_and_the_marker_follows(gap):
    cfg = T.LookaheadConfig(fact_gap=gap)
    e = T.make_example(T.train_seed(11), 512, cfg)
    fpos = e["fact_positions"].view(-1, cfg.block_records)
    assert bool((fpos.diff(dim=1) == gap + 1).all())
    assert torch.equal(e["marker_positions"], fpos[:, -1] + gap + 1)
    ids = e["input_ids"]
    between = [p for row in fpos.tolist() for a, b in zip(row, row[1:]) for p in range(a + 1, b)]
    assert all(int(ids[p]) >= cfg.filler_base for p in between)


def test_pretrain_on_the_task_starts_facts_from_their_key_and_value(tmp_path):
    """`kvpop pretrain --task lookahead`: the task's vocabulary, its embedding start, and an export."""
    from transformers import Qwen3ForCausalLM

    from kvpop.cli.pretrain import main as pretrain_main

    tiny = ["--curriculum", "64:2", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--intermediate", "32", "--eval-every", "1000", "--eval-n", "2", "--no-progress", "--lr", "1e-9",
            "--warmup", "1"]
    assert pretrain_main(["--task", "lookahead", "--out", str(tmp_path / "run"), "--steps", "1", *tiny]) == 0
    m = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "run" / "model_final"))
    w = m.get_input_embeddings().weight
    assert w.shape[0] == CFG.vocab_size
    k, v = 17, 5
    assert torch.allclose(w[CFG.fact_id(k, v)], (w[CFG.key_id(k)] + w[CFG.value_id(v)]) / 2 ** 0.5, atol=1e-5)
    rec_dir = tmp_path / "shipped"
    assert pretrain_main(["--task", "lookahead", "--out", str(tmp_path / "run"), "--export", str(rec_dir),
                   "--export-from", "model_final", "--export-lengths", "64", *tiny]) == 0
    import json

    rec = json.loads((rec_dir / "training.json").read_text())
    assert rec["task"].startswith("lookahead-trace") and set(rec["test_accuracy"]) == {"64"}

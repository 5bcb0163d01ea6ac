"""studies.scorer_probe: the clean-label probe and the target breakdown on the shipped lookahead model."""
import pytest
import torch

from kvpop.demo import lookahead_task as T
from kvpop.evaluation.evaluate import load_base_model
from studies import scorer_probe as P


@pytest.fixture(scope="module")
def model():
    return load_base_model(T.SHIPPED_MODEL)


def test_layer_inputs_are_the_pre_rope_keys_and_values(model):
    ex = T.make_example(T.valid_seed(1), 128)
    k, v = P.layer_inputs(model, ex["input_ids"][None], 0)
    hkv, d = model.config.num_key_value_heads, model.config.head_dim
    assert k.shape == v.shape == (1, hkv, 128, d)
    # the same token id gives the same pre-RoPE key in layer 0 wherever it stands (no position in it)
    ids = ex["input_ids"]
    fp = ex["fact_positions"]
    torch.testing.assert_close(k[0, :, fp[0]], P.layer_inputs(model, ids[fp[0]:fp[0] + 1][None], 0)[0][0, :, 0])
    # the keys change with the layer's input: layer 1 mixes context
    k1, _ = P.layer_inputs(model, ex["input_ids"][None], 1)
    assert not torch.allclose(k, k1)


def test_kept_in_topk_counts_the_kept_facts_a_score_ranks_first():
    ex = T.make_example(T.valid_seed(2), 512)
    perfect = P._label(ex, 512)
    n_kept = int(ex["record_keep"].sum())
    assert P._kept_in_topk(perfect, ex, n_kept) == 1.0
    assert P._kept_in_topk(-perfect, ex, n_kept) == 0.0
    assert P._kept_in_topk(perfect, ex, n_kept // 2) == pytest.approx((n_kept // 2) / n_kept)


def test_target_breakdown_rows(model):
    rows = P.target_breakdown(model, T.make_example(T.valid_seed(0), 256), k=8)
    assert len(rows) == model.config.num_hidden_layers * model.config.num_key_value_heads
    for r in rows:
        assert {"layer", "kv_head", "kept_facts", "dropped_facts", "filler", "kept_in_target_top8"} <= set(r)
        assert 0.0 <= r["kept_in_target_top8"] <= 1.0


@pytest.mark.parametrize("features", ["model", "random"])
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_probe_trains_and_reports(model, scorer, features):
    r = P.probe(model, scorer, steps=2, length=128, n_valid=1, k=4, features=features)
    assert r["scorer"] == scorer and r["features"] == features
    assert 0.0 <= r["kept_in_top4"] <= 1.0 and r["last_loss"] > 0


def test_probe_cli(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert P.main(["--steps", "1", "--n-valid", "1", "--scorers", "mlp", "--features", "random",
                   "--out", str(out)]) == 0
    import json

    rec = json.loads(out.read_text())
    assert set(rec) >= {"command", "target_breakdown", "mlp"} and "mlstm" not in rec
    assert P.main(["--scorers", "lstm"]) == 2
    assert "--scorers takes" in capsys.readouterr().err
    assert P.main(["--lr", "nan"]) == 2


def test_probe_bad_inputs(model):
    with pytest.raises(ValueError, match="scorer must be"):
        P.probe(model, "lstm", steps=1)
    with pytest.raises(ValueError, match="steps must be"):
        P.probe(model, "mlp", steps=0)
    with pytest.raises(ValueError, match="features must be"):
        P.probe(model, "mlp", steps=1, features="zeros")

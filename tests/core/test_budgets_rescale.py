"""kvpop.core.budgets: rescale / set_importance / rebudget (head budgets at another mean), the head-budgets
file, and ablation_importance with the exact teacher label as the mask (teacher=)."""
import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

import kvpop  # noqa: E402
from kvpop import KVpopConfig  # noqa: E402
from kvpop.core.budgets import (  # noqa: E402
    ablation_importance,
    allocate,
    read_head_budgets,
    rebudget,
    rescale,
    set_importance,
    write_head_budgets,
)

HB = ((10, 50), (30, 30))  # 2 layers x 2 KV heads, mean 30
CFG = KVpopConfig(sinks=2, window=8, budget=30, head_budgets=HB)
IMP = [[1.0, 3.0], [0.0, 2.0]]


def test_rescale():
    assert rescale(CFG, 30) is CFG
    u = CFG.replace(head_budgets=None)
    assert rescale(u, 40) == u.replace(budget=40)
    got = rescale(CFG, 40, importance=IMP, min_k=1)
    assert got.budget == 40 and got.head_budgets == allocate(IMP, total=160, sinks=2, window=8, min_k=1)
    assert sum(map(sum, got.head_budgets)) == 160
    with pytest.raises(ValueError, match="budget 40 needs the importance"):
        rescale(CFG, 40)
    with pytest.raises(ValueError, match=r"importance has shape \(1, 2\)"):
        rescale(CFG, 40, importance=[[1.0, 2.0]])
    with pytest.raises(TypeError, match="KVpopConfig"):
        rescale({"budget": 30}, 40)


def test_file_round_trip_and_errors(tmp_path):
    p = tmp_path / "hb.json"
    write_head_budgets(p, HB, importance=IMP, min_k=1, rule="ablation")
    d = read_head_budgets(p)
    assert d["head_budgets"] == HB and d["budget"] == 30 and d["importance"] == IMP and d["min_k"] == 1
    assert d["rule"] == "ablation"
    p.write_text(json.dumps([[10, 50], [30, 30]]))
    d = read_head_budgets(p)
    assert d["head_budgets"] == HB and d["importance"] is None and d["min_k"] == 0
    for text, msg in (("[[10, 50], [30]]", "same count"), ("[[10, 51], [30, 30]]", "not a multiple"),
                      ("[]", "non-empty list"), ("[[true, 59], [30, 30]]", "lists of integers"),
                      ('{"head_budgets": [[10, 50], [30, 30]], "importance": [[1, 2]]}', "importance has shape"),
                      ('{"head_budgets": [[10, 50], [30, 30]], "min_k": -1}', "min_k"), ("{", "as JSON")):
        p.write_text(text)
        with pytest.raises(ValueError, match=msg):
            read_head_budgets(p)
    with pytest.raises(ValueError, match="no such file"):
        read_head_budgets(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def shipped():
    from transformers import AutoModelForCausalLM

    from kvpop.demo import task

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(task.SHIPPED_MODEL)).eval()
    ids = task.make_batch([task.valid_seed(i) for i in range(2)], 96)["input_ids"]
    return model, ids


def test_rebudget_a_patched_model(shipped, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, _ = shipped
    m = kvpop.patch(copy.deepcopy(model), CFG)
    scorers = {n: p.clone() for n, p in m.state_dict().items() if ".kvpop." in n}
    with pytest.raises(ValueError, match="needs the importance"):
        rebudget(m, 40)
    assert rebudget(m, 30) is m and kvpop.get_config(m) == CFG
    set_importance(m, IMP)
    rebudget(m, 40)
    assert kvpop.get_config(m).head_budgets == allocate(IMP, total=160, sinks=2, window=8)
    rebudget(m, 30)  # back to the rows it was patched with, whatever allocate would give at 30
    assert kvpop.get_config(m) == CFG and allocate(IMP, total=120, sinks=2, window=8) != HB
    assert all(torch.equal(p, scorers[n]) for n, p in m.state_dict().items() if ".kvpop." in n)  # scorers kept
    u = kvpop.patch(copy.deepcopy(model), CFG.replace(head_budgets=None))
    rebudget(u, 40)
    assert kvpop.get_config(u) == CFG.replace(head_budgets=None, budget=40)
    with pytest.raises(ValueError, match="no head_budgets"):
        set_importance(u, IMP)
    with pytest.raises(ValueError, match=r"importance has shape \(2, 3\)"):
        set_importance(m, [[1, 2, 3], [1, 2, 3]])


def test_ablation_with_the_exact_teacher_label(shipped, monkeypatch):
    """mask_source="teacher" with target_source="teacher" ranks by the frozen teacher's label: teacher= is
    required, and it is the teacher's attention that decides (another teacher, another importance)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, ids = shipped
    cfg = KVpopConfig(sinks=2, window=8, budget=30, mask_source="teacher", target_source="teacher", label="max")
    with pytest.raises(ValueError, match="pass teacher="):
        ablation_importance(model, [ids], config=cfg)
    exact = ablation_importance(model, [ids], config=cfg, teacher=copy.deepcopy(model))
    assert exact.shape == (2, 2) and float(exact.max()) > 0 and not kvpop.is_patched(model)
    split = ablation_importance(model, [ids[:1], ids[1:]], config=cfg, teacher=model)  # targets per batch
    assert torch.allclose(exact, split, rtol=0, atol=1e-5)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert not torch.equal(exact, ablation_importance(model, [ids], config=cfg, teacher=other))
    # in layer 0 the student's own label (dense normaliser) is the teacher's: the same mask there, so the
    # ablation of a layer-0 head changes the same tokens; both measures agree on which layer-0 head matters most
    own = ablation_importance(model, [ids], config=cfg.replace(target_source="student"))
    assert int(own[0].argmax()) == int(exact[0].argmax())

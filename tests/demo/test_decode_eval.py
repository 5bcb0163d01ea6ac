"""Reads measured by token-by-token decoding equal the one-call prefill's (kvpop.evaluation.decode_eval)."""
import copy

import pytest
import torch
from tiny import kvtrace_model

from kvpop.core.checkpoint import save_scorers
from kvpop.core.patching import patch
from kvpop.demo import task as T
from kvpop.evaluation import evaluate as E
from kvpop.evaluation.decode_eval import decode_check, decode_predictions

L = 96


@pytest.fixture(scope="module")
def base():
    return kvtrace_model()


@pytest.mark.parametrize("policy", ["kvpop-mlp", "kvpop-mlstm", "fixed-finetune"])
def test_decoding_gives_the_prefill_reads(base, policy, tmp_path):
    kw = dict(sinks=2, window=6, budget=16)
    if policy == "fixed-finetune":
        model = E.policy_model(base, policy, finetuned=base, **kw)
    else:
        m = copy.deepcopy(base)
        torch.manual_seed(1)
        patch(m, scorer=policy.split("-")[1], **kw)
        save_scorers(m, tmp_path / "s.safetensors")
        model = E.policy_model(base, policy, scorers=tmp_path / "s.safetensors", **kw)
    exs = [T.make_example(T.test_seed(i), L) for i in range(3)]
    r = decode_check(model, exs, policy, 12)
    assert r["graded"] == sum(ex["answers"].numel() for ex in exs)
    assert r["differ"] == 0 and r["decode_correct"] == r["prefill_correct"]
    # the decoded predictions of every position equal one teacher-forced prefill's
    ids = torch.stack([ex["input_ids"] for ex in exs])
    dec = decode_predictions(model, ids, policy, 12)
    full = torch.cat([E.policy_logits(model, ids[i:i + 1], policy, 12).argmax(-1) for i in range(3)])
    assert torch.equal(dec, full)


def test_decode_bad_inputs(base):
    model = E.policy_model(base, "streaming", sinks=2, window=6, budget=16)
    ids = T.make_example(T.test_seed(0), L)["input_ids"]
    with pytest.raises(ValueError, match="prompt must be an int"):
        decode_predictions(model, ids, "streaming", 12, prompt=0)
    with pytest.raises(ValueError, match="non-dense policy"):
        decode_predictions(model, ids, "dense")
    with pytest.raises(ValueError, match="kvpop-patched"):
        decode_predictions(base, ids, "streaming")
    with pytest.raises(ValueError, match="at least one example"):
        decode_check(model, [], "streaming", 12)


def test_dms_decoding_gives_the_prefill_reads(base, tmp_path):
    from kvpop.baselines import dms as D
    from kvpop.baselines.dms import budget as DE

    m = copy.deepcopy(base)
    D.patch_dms(m, sinks=2, window=4)
    torch.manual_seed(2)
    with torch.no_grad():
        for la in D.dms_layers(m):
            la.gate.weight.normal_(0, 1.0)
            la.gate.bias.zero_()
    D.save_dms(m, tmp_path / DE.GATES)
    model = E.policy_model(base, "dms", scorers=tmp_path / DE.GATES, finetuned=base, sinks=2, window=4)
    exs = [T.make_example(T.test_seed(i), L) for i in range(2)]
    thr = DE.calibrate_threshold(model, torch.stack([T.make_example(T.valid_seed(i), L)["input_ids"]
                                                      for i in range(2)]), 14)
    r = decode_check(model, exs, "dms", 14, threshold=thr)
    assert r["differ"] == 0 and r["decode_correct"] == r["prefill_correct"] and r["dms_threshold"] == thr
    ids = torch.stack([ex["input_ids"] for ex in exs])
    full = torch.cat([E.policy_logits(model, ids[i:i + 1], "dms", threshold=thr).argmax(-1) for i in range(2)])
    assert torch.equal(decode_predictions(model, ids, "dms", threshold=thr), full)
    with pytest.raises(ValueError, match="fixed gate threshold"):
        decode_check(model, exs, "dms", 14)

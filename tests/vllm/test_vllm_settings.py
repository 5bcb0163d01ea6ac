"""``kvpop.vllm.settings.resolve`` (no vLLM import): head-adaptive ``head_budgets`` are served (the packed
layout, docs/DESIGN.md section 5); a budget that would not rescale them is refused, never served uniform.  What the
plugin loads is checked as ``kvpop.load_scorers`` checks it, unknown ``kvpop_*`` keys are refused by name, and with
vLLM installed the checks run where the engine's config is built (the caller's process), no engine started."""
import pytest

from kvpop.vllm.settings import resolve

S, W, B = 4, 8, 20  # 2 layers x 2 KV heads, the uniform total 80
HB = [[S + W, 2 * B - S - W], [B, B]]


def test_vllm_serves_head_budgets():
    cfg = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": S, "window": W, "budget": B, "head_budgets": HB}}
    got = resolve(cfg)
    assert got.config.head_budgets == tuple(map(tuple, HB)) and got.config.budget == B
    ok = resolve({"kvpop_policy": "streaming", "kvpop_config": {"sinks": S, "window": W, "budget": B}})
    assert ok.config.head_budgets is None and ok.config.budget == B


def test_vllm_refuses_budget_off_the_head_budgets_total():
    cfg = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": S, "window": W, "budget": 2 * B, "head_budgets": HB}}
    with pytest.raises(ValueError, match="head_budgets must hold the uniform total"):
        resolve(cfg)


def _scorer_file(tmp_path, head_budgets, scorer="mlp", fill=None, model=None):
    """A scorer file of a toy 2-layer Qwen3 (or of ``model``, a model directory), its first tensor set to ``fill``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop

    torch.manual_seed(0)
    m = (Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32) if model else
         Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)))
    kvpop.patch(m, sinks=S, window=W, budget=B, head_budgets=head_budgets, scorer=scorer)
    if fill is not None:
        with torch.no_grad():
            next(iter(kvpop.kvpop_layers(m)[0].parameters())).fill_(fill)
    path = tmp_path / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    return str(path)


def test_vllm_head_budgets_at_another_budget_by_their_importance(tmp_path):
    """A run's scorer file at another budget: the rows are allocated anew from head_budgets.json's importance (the
    rows kvpop eval's hf engine serves at that budget); without the importance, refused naming the file."""
    from kvpop.core.budgets import allocate, rescale, write_head_budgets

    importance = [[0.0, 3.0], [1.0, 1.0]]
    rows = allocate(importance, total=4 * B, sinks=S, window=W)
    path = _scorer_file(tmp_path, rows)
    with pytest.raises(ValueError, match="head_budgets.json with their importance"):
        resolve({"kvpop_scorers": path, "kvpop_config": {"budget": 30}})
    write_head_budgets(tmp_path / "head_budgets.json", rows, importance=importance)
    got = resolve({"kvpop_scorers": path, "kvpop_config": {"budget": 30}}).config
    want = rescale(got.replace(budget=B, head_budgets=rows), 30, importance=importance)
    assert got.budget == 30 and got.head_budgets == want.head_budgets != rows
    assert resolve({"kvpop_scorers": path, "kvpop_config": {"budget": B}}).config.head_budgets == rows


def test_vllm_serves_the_mlstm_with_uniform_budgets_only(tmp_path):
    got = resolve({"kvpop_scorers": _scorer_file(tmp_path, None, "mlstm")})
    assert got.config.scorer == "mlstm" and got.uses_scorer
    (tmp_path / "hb").mkdir()
    path = _scorer_file(tmp_path / "hb", [[S + W, 2 * B - S - W], [B, B]], "mlstm")
    with pytest.raises(ValueError, match="mLSTM scorer with uniform budgets only.*'mlstm' scorer with head_budgets"):
        resolve({"kvpop_scorers": path})


@pytest.mark.parametrize("fill", [float("nan"), 3e38])
def test_vllm_refuses_the_scorer_files_load_scorers_refuses(tmp_path, fill):
    """A file with NaN or overflowing (3e38) weights was served; now hf_overrides refuses it with load_scorers's
    own message (the same check, kvpop.core.checkpoint.SCORERS.read_tensors)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import kvpop
    from kvpop.vllm import hf_overrides
    from kvpop.vllm.settings import check_scorer_file

    path = _scorer_file(tmp_path, None, fill=fill)
    with pytest.raises(ValueError) as want:
        kvpop.load_scorers(Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, head_dim=8)), path)
    assert path in str(want.value) and ("non-finite" in str(want.value) or "magnitude" in str(want.value))
    with pytest.raises(ValueError) as got:
        hf_overrides(path)
    assert str(got.value) == str(want.value)
    with pytest.raises(ValueError) as got:
        check_scorer_file(path)
    assert str(got.value) == str(want.value)


def test_vllm_refuses_a_scorer_file_of_another_model(tmp_path):
    from transformers import Qwen3Config

    from kvpop.vllm.settings import check_scorer_file

    path = _scorer_file(tmp_path, None)
    check_scorer_file(path, Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="saved for a model of num_layers=2, this model has num_hidden_layers=3"):
        check_scorer_file(path, Qwen3Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="head_dim=8, this model has head_dim=32"):
        check_scorer_file(path, {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 32})


@pytest.mark.parametrize("key", ["kvpop_configg", "KVPOP_CONFIG", "kvpop-config", "kvpop_budget", "kvpop"])
def test_vllm_refuses_unknown_kvpop_keys_by_name(key):
    """A misspelt settings key was ignored and the defaults (budget 2048, window 256) served."""
    from transformers import Qwen3Config

    cfg = {"kvpop_policy": "streaming", key: {"budget": 64}}
    with pytest.raises(ValueError, match=f"unknown kvpop setting '{key}'.*reads kvpop_scorers, kvpop_policy"):
        resolve(cfg)
    hf = Qwen3Config()
    for k, v in cfg.items():
        setattr(hf, k, v)
    with pytest.raises(ValueError, match=f"unknown kvpop setting '{key}'"):
        resolve(hf)
    assert "did you mean 'kvpop_config'" in str(pytest.raises(ValueError, resolve, {"kvpop_configg": {}}).value)


def test_engine_config_refuses_in_the_callers_process(tmp_path):
    """With vLLM: a bad scorer file, a misspelt key, a scorer file of another model and prefix caching are refused
    while the engine's config is built, in this process, with the reason (they were raised in the engine core's
    process, and the caller saw only "Engine core initialization failed"); no engine is started.  The engine
    core's own load (load_scorer_file) makes the same tensor checks."""
    pytest.importorskip("vllm.entrypoints.llm")
    from vllm.engine.arg_utils import EngineArgs

    from kvpop import KVpopConfig, KVpopLayer
    from kvpop.demo import task
    from kvpop.vllm import ARCHITECTURE
    from kvpop.vllm.model import load_scorer_file

    model = str(task.SHIPPED_MODEL)
    (tmp_path / "nan").mkdir()
    (tmp_path / "ok").mkdir()
    nan = _scorer_file(tmp_path / "nan", None, fill=float("nan"), model=model)
    ok = _scorer_file(tmp_path / "ok", None, model=model)
    toy = _scorer_file(tmp_path, None)

    def config(prefix_caching=False, **overrides):
        return EngineArgs(model=model, hf_overrides={"architectures": [ARCHITECTURE], **overrides},
                          enable_prefix_caching=prefix_caching, max_model_len=256,
                          enforce_eager=True).create_engine_config()

    assert config(kvpop_scorers=ok).model_config.hf_config.kvpop_scorers == ok
    for kw, says in (({"kvpop_scorers": nan}, "non-finite value"),
                     ({"kvpop_policy": "streaming", "kvpop_configg": {"budget": 64}}, "unknown kvpop setting"),
                     ({"kvpop_scorers": toy}, "saved for a model of head_dim=8, this model has head_dim=32"),
                     ({"kvpop_scorers": ok, "prefix_caching": True}, "cannot share prefix blocks")):
        with pytest.raises(ValueError, match=says):
            config(**kw)
    layers = {f"model.layers.{i}.self_attn.kvpop": KVpopLayer(KVpopConfig(sinks=S, window=W, budget=B), 2, 32, i)
              for i in range(2)}
    assert len(load_scorer_file(ok, layers)) == len([k for m in layers.values() for k in m.state_dict()])
    with pytest.raises(ValueError, match="non-finite value"):
        load_scorer_file(nan, layers)


def test_kvpop_pack_is_rows_slots_or_the_backends_default():
    """``kvpop_pack`` (how head-adaptive budgets' heads sit in the packed block) reaches the settings; another value
    is refused by name with the allowed ones."""
    from kvpop.vllm import hf_overrides

    base = {"kvpop_policy": "streaming", "kvpop_config": {"budget": 64, "window": 16, "sinks": 4,
                                                          "head_budgets": ((20, 108), (64, 64))}}
    assert resolve(base).pack is None
    assert resolve({**base, "kvpop_pack": "rows"}).pack == "rows"
    assert hf_overrides(policy="streaming", pack="slots", **base["kvpop_config"])["kvpop_pack"] == "slots"
    with pytest.raises(ValueError, match=r"kvpop_pack must be one of \['rows', 'slots'\].*got 'row'"):
        resolve({**base, "kvpop_pack": "row"})
    uniform = {"kvpop_policy": "streaming", "kvpop_config": {"budget": 64, "window": 16}, "kvpop_pack": "rows"}
    with pytest.raises(ValueError, match=r"kvpop_pack='rows' lays out .* head-adaptive.*uniform \(budget=64"):
        resolve(uniform)

"""Round five (issue 59), with vLLM: kvpop settings on a model served by vLLM's own class (no KVpop architecture)
and a ``kv_dtype`` that contradicts the engine's cache dtype are refused where the engine's config is built, in the
caller's process (they were accepted: the engine served dense, or dropped the dtype). No engine is started."""
import pytest

pytest.importorskip("vllm.entrypoints.llm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from kvpop.demo import task  # noqa: E402
from kvpop.vllm import ARCHITECTURE  # noqa: E402

STREAMING = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": 4, "window": 32, "budget": 64}}


def _config(overrides, **kw):
    return EngineArgs(model=str(task.SHIPPED_MODEL), hf_overrides=overrides, max_model_len=256, enforce_eager=True,
                      enable_prefix_caching=False, **kw).create_engine_config()


@pytest.mark.parametrize("arch", [None, ["Qwen3ForCausalLM"]])
def test_kvpop_settings_without_the_kvpop_architecture_are_refused(arch):
    overrides = {**STREAMING, **({"architectures": arch} if arch else {})}
    with pytest.raises(ValueError, match="carries kvpop settings .* but is served as 'Qwen3ForCausalLM'"):
        _config(overrides)
    assert _config({}).model_config.architecture == "Qwen3ForCausalLM"  # a plain model is served as before


def test_kv_dtype_contradicting_the_engines_cache_dtype_is_refused():
    with_int8 = {"architectures": [ARCHITECTURE], **STREAMING,
                 "kvpop_config": {**STREAMING["kvpop_config"], "kv_dtype": "int8"}}
    with pytest.raises(ValueError, match="kv_dtype='int8' contradicts the engine's kv_cache_dtype='auto'"):
        _config(with_int8)
    assert _config(with_int8, kv_cache_dtype="int8_per_token_head").cache_config.cache_dtype == \
        "int8_per_token_head"

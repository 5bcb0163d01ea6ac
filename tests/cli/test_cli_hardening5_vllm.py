"""Round five (issue 59): the vLLM plugin's settings checks that import no vLLM (kvpop.vllm.settings), so they run in
the main environment; the engine hooks that call them are tested with vLLM in tests/vllm/test_vllm_hardening5.py."""
import pytest

from kvpop.vllm import ARCHITECTURE
from kvpop.vllm.settings import OTHER_ARCHITECTURES, check_architecture, check_kv_dtype, resolve


@pytest.mark.parametrize("arch", [None, *OTHER_ARCHITECTURES])
def test_kvpop_settings_without_the_kvpop_architecture_are_refused(arch):
    overrides = {"kvpop_policy": "streaming", "kvpop_config": {"sinks": 4, "window": 8, "budget": 32}}
    with pytest.raises(ValueError, match="carries kvpop settings \\(kvpop_policy, kvpop_config\\) but is served as"):
        check_architecture(overrides, arch)
    check_architecture(overrides, ARCHITECTURE)  # the plugin's own: accepted
    check_architecture({"hidden_size": 64}, arch)  # a plain model: nothing to say


@pytest.mark.parametrize("kv_dtype, engine, ok", [
    ("int8", "auto", False), ("fp8", "int8_per_token_head", False), ("int8", "int8_per_token_head", True),
    ("fp8", "fp8_per_token_head", True), (None, "int8_per_token_head", True), (None, "auto", True),
])
def test_kv_dtype_must_be_the_engines_cache_dtype(kv_dtype, engine, ok):
    cfg = {"sinks": 4, "window": 8, "budget": 32, **({"kv_dtype": kv_dtype} if kv_dtype else {})}
    settings = resolve({"kvpop_policy": "streaming", "kvpop_config": cfg})
    assert settings.config.kv_dtype == kv_dtype
    if ok:
        check_kv_dtype(settings, engine)
        return
    with pytest.raises(ValueError, match=f"kv_dtype='{kv_dtype}' contradicts the engine's kv_cache_dtype='{engine}'"):
        check_kv_dtype(settings, engine)

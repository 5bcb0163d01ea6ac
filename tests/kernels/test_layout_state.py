"""The decode state as one object (``kvpop_kernels.layout.SlotState``) and the layouts built over it: a layout's
empty state, the state's row maps and reset, the quantised layout as a kind of its base (no forwarding), and
the refusal of loose tensors."""
import copy

import pytest
import torch

from kvpop_kernels import SlotState, fixed_budget_decode
from kvpop_kernels.layout import PackedLayout, QuantizedLayout, SlotLayout, UniformLayout


def test_empty_state_and_row_maps():
    st = UniformLayout(10).empty_state(3, 2, 2, 4, k_dim=8, v_dim=6, dtype=torch.bfloat16, device="cpu")
    assert [n for n, _ in st.named()] == ["k_cache", "v_cache", "slot_pos", "slot_prio"]
    assert st.k_cache.shape == (3, 2, 10, 8) and st.v_cache.shape == (3, 2, 10, 6)
    assert st.slot_prio.shape == (3, 2, 4) and bool((st.slot_pos == -1).all())
    assert st.nbytes() == 3 * 2 * (10 * (8 + 6) * 2 + 10 * 4 + 4 * 4)
    sub = st.map(lambda t: t[[0, 2]])
    assert all(t.shape[0] == 2 for t in sub.tensors())
    st.slot_pos.fill_(5)
    st.k_cache.fill_(1.0)
    st.reset()
    assert bool((st.slot_pos == -1).all()) and not st.k_cache.any() and bool((st.slot_prio == float("-inf")).all())


@pytest.mark.parametrize("base", [UniformLayout(10), PackedLayout((8, 12))], ids=["uniform", "packed"])
def test_quantized_layout_is_a_kind_of_its_base(base):
    lay = QuantizedLayout("int8", base)
    assert isinstance(lay, QuantizedLayout) and isinstance(lay, type(base)) and lay.geometry is base
    assert lay.spans(2, 2, 4) == base.spans(2, 2, 4) and lay.packed == base.packed
    assert lay == QuantizedLayout("int8", base) and hash(lay) == hash(QuantizedLayout("int8", base))
    assert lay != base and copy.deepcopy(lay) == lay and repr(lay) == f"QuantizedLayout('int8', {base!r})"
    st = lay.empty_state(2, 2, 2, 4, k_dim=8, v_dim=8, dtype=torch.float32, device="cpu")
    assert st.k_cache.dtype == torch.int8 and st.k_scale.shape == st.slot_pos.shape == st.v_scale.shape
    # only what quantisation changes is defined on the quantised layout; the places are the base's own methods
    own = {name for name in vars(QuantizedLayout) if not name.startswith("__")}
    assert {"spans", "state_shapes", "head_groups", "attend", "kernel_meta"}.isdisjoint(own)
    with pytest.raises(TypeError, match="base must be a UniformLayout or PackedLayout"):
        QuantizedLayout("int8", lay)
    with pytest.raises(TypeError, match="base must be a UniformLayout or PackedLayout"):
        QuantizedLayout("int8", SlotLayout())


def test_decode_refuses_loose_tensors():
    q, kn, vn = torch.randn(4, 16), torch.randn(2, 16), torch.randn(2, 16)
    kc, vc = torch.zeros(2, 10, 16), torch.zeros(2, 10, 16)
    sp, pr = torch.full((2, 10), -1, dtype=torch.int32), torch.full((2, 4), float("-inf"))
    with pytest.raises(TypeError, match=r"state must be a kvpop_kernels.layout.SlotState\(k_cache, v_cache, "
                                        r"slot_pos, slot_prio\), got Tensor"):
        fixed_budget_decode(q, kn, vn, kc, torch.zeros(2), pos=0, sinks=2, window=4)
    out, _ = fixed_budget_decode(q, kn, vn, SlotState(kc, vc, sp, pr), torch.zeros(2), pos=0, sinks=2, window=4)
    assert out.shape == (4, 16) and sp[:, 0].tolist() == [0, 0] and torch.equal(kc[:, 0], kn)

"""``kvpop.vllm.quantized``: fp8 codes with one scale per slot and KV head inside a paged byte cache.

Oracle: ``kvpop_kernels.reference.quantized_fixed_budget_decode`` (the quantised step of ``KVpopCache``) run per
request on its own flat state, step by step beside batched :func:`quantized.decode_step` over shuffled block
tables (stale bytes everywhere, keys stored ``[D, bs]`` per block); uniform and packed (head-adaptive) budgets,
shapes where ``B`` is no multiple of the block size.  The prompt / chunk path against the float slots'
:func:`slots.extend` on the dequantised cache.  No vLLM needed except for the block-layout probe.
"""
import random

import pytest
import torch

from kvpop.vllm import quantized
from kvpop.vllm.slots import PackedSlots, UniformSlots, extend, gather_slots
from kvpop_kernels import reference
from kvpop_kernels.layout import quantize

D, HQ, HKV = 8, 6, 3
S, W = 3, 5
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _pytorch_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _paged(num_blocks, rows, bs, seed):
    """Byte views ``[nb, rows, bs, D]`` (keys ``[D, bs]`` per block), scale and side tables, all stale."""
    g = torch.Generator().manual_seed(seed)
    K = torch.randint(0, 256, (num_blocks, rows, D, bs), generator=g, dtype=torch.uint8).transpose(2, 3)
    V = torch.randint(0, 256, (num_blocks, rows, bs, D), generator=g, dtype=torch.uint8)
    ks, vs = torch.rand(num_blocks, rows, bs, generator=g), torch.rand(num_blocks, rows, bs, generator=g)
    pos = torch.randint(-5, 1000, (num_blocks, rows, bs), generator=g, dtype=torch.int32)
    prio = torch.randn(num_blocks, rows, bs, generator=g) * 100
    return K, V, ks, vs, pos, prio


def _in_page(num_blocks, rows, bs, seed, kv_dtype):
    """Views of a per-token-head page (vLLM's ``[K | K scale | V | V scale]`` per slot, ``quantized.page_views``),
    stale bytes everywhere, and stale side tables."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.int8 if kv_dtype == "int8" else torch.uint8
    kv = torch.randint(0, 256, (num_blocks, rows, bs, 2 * (D + 4)), generator=g, dtype=torch.uint8).view(dtype)
    pos = torch.randint(-5, 1000, (num_blocks, rows, bs), generator=g, dtype=torch.int32)
    prio = torch.randn(num_blocks, rows, bs, generator=g) * 100
    return (*quantized.page_views(kv, D), pos, prio)


def _ref_state(budgets, packed, kv_dtype="fp8"):
    T = sum(budgets)
    dt = FP8 if kv_dtype == "fp8" else torch.int8
    if packed:
        return dict(k=torch.zeros(T, D, dtype=dt), v=torch.zeros(T, D, dtype=dt), ks=torch.zeros(T),
                    vs=torch.zeros(T), pos=torch.full((T,), -1, dtype=torch.int32),
                    prio=torch.full((T - len(budgets) * (S + W),), float("-inf")))
    B = budgets[0]
    return dict(k=torch.zeros(HKV, B, D, dtype=dt), v=torch.zeros(HKV, B, D, dtype=dt), ks=torch.zeros(HKV, B),
                vs=torch.zeros(HKV, B), pos=torch.full((HKV, B), -1, dtype=torch.int32),
                prio=torch.full((HKV, B - S - W), float("-inf")))


def _ref_slots(st, budgets, packed):
    """The reference state per head: ``[(codes k, codes v, scale k, scale v, pos)]`` of each head's slots."""
    out, off = [], 0
    for h, b in enumerate(budgets):
        sl = slice(off, off + b) if packed else (h, slice(None))
        out.append(tuple(st[f][sl] for f in ("k", "v", "ks", "vs", "pos")))
        off += b
    return out


def _check_state(K, V, ks, vs, spos, layout, table, st, budgets, packed, n, what):
    """The request's slots ``[0, min(n, B_h))`` hold exactly the reference's slots (bytes, scales, positions)."""
    bs = K.shape[2]
    for h, (rk, rv, rks, rvs, rpos) in enumerate(_ref_slots(st, budgets, packed)):
        m = min(n, budgets[h])
        j = torch.arange(m)
        blk, row, off = layout.addr(table[None], torch.full((1, m), h), j[None], bs)
        at = (blk[0], row[0], off[0])
        assert torch.equal(spos[at], rpos[:m]), f"{what}: head {h} positions"
        assert torch.equal(K[at].view(torch.uint8), rk[:m].view(torch.uint8)), f"{what}: head {h} key codes"
        assert torch.equal(V[at].view(torch.uint8), rv[:m].view(torch.uint8)), f"{what}: head {h} value codes"
        assert torch.equal(ks[at], rks[:m]) and torch.equal(vs[at], rvs[:m]), f"{what}: head {h} scales"


@pytest.mark.parametrize("storage", ["fp8 side tables", "int8 in page", "fp8 in page"])
@pytest.mark.parametrize("budgets,bs,rows", [((13,) * HKV, 4, HKV), ((9, 17, 13), 4, 4), ((8, 21, 10), 32, 3)],
                         ids=["uniform-B13-bs4", "packed-9-17-13-bs4", "packed-8-21-10-bs32"])
def test_decode_steps_equal_reference(budgets, bs, rows, storage):
    """Batched decode steps of 3 requests (random subsets per step, from position 0) equal the reference's per
    request: the same key/value codes, scales and positions in every slot, the output within 1e-5.  Plain fp8
    (codes in a byte cache, scales in side tables) and the per-token-head pages (int8 or fp8 codes and their
    scales in the page)."""
    kv_dtype = storage.split()[0]
    torch.manual_seed(0)
    rng = random.Random(1)
    packed = len(set(budgets)) > 1
    layout = PackedSlots(budgets, rows) if packed else UniformSlots(budgets[0], HKV)
    per_req = -(-sum(budgets) // (rows * bs)) if packed else -(-budgets[0] // bs)
    n_req, steps = 3, 45
    num_blocks = per_req * n_req + 2
    if storage.endswith("in page"):
        K, V, ks, vs, spos, sprio = _in_page(num_blocks, rows, bs, 2, kv_dtype)
    else:
        K, V, ks, vs, spos, sprio = _paged(num_blocks, rows, bs, seed=2)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = [torch.tensor(perm[i * per_req:(i + 1) * per_req], dtype=torch.int32) for i in range(n_req)]
    seqs = [dict(q=torch.randn(steps, HQ, D), k=torch.randn(steps, HKV, D) * (1 + 10 * i),
                 v=torch.randn(steps, HKV, D), p=torch.randn(steps, HKV)) for i in range(n_req)]
    for x in seqs:
        x["k"][5, 1] = 0.0  # a zero vector: scale 0
    refs = [_ref_state(budgets, packed, kv_dtype) for _ in range(n_req)]
    done = [0] * n_req
    while min(done) < steps:
        dec = [i for i in range(n_req) if done[i] < steps and rng.random() < 0.7]
        if not dec:
            continue
        idx = torch.tensor([done[i] for i in dec])
        bt = torch.stack([tables[i] for i in dec])
        kn, vn, pn, qn = (torch.stack([seqs[i][f][done[i]] for i in dec]) for f in "kvpq")
        quantized.decode_step(K, V, ks, vs, spos, sprio, bt, idx, kn, vn, pn, sinks=S, window=W, layout=layout)
        out = quantized.decode_attention(K, V, ks, vs, bt, idx, qn, layout=layout, scale=D ** -0.5)
        for r, i in enumerate(dec):
            t, st, x = done[i], refs[i], seqs[i]
            leave = x["p"][t - W] if t - W >= 0 else torch.zeros(HKV)
            want, _ = reference.quantized_fixed_budget_decode(
                x["q"][t], x["k"][t], x["v"][t], st["k"], st["v"], st["ks"], st["vs"], st["pos"], st["prio"], leave,
                pos=t, sinks=S, window=W, kv_dtype=kv_dtype, scale=D ** -0.5, head_budgets=budgets if packed else None)
            torch.testing.assert_close(out[r], want, atol=1e-5, rtol=1e-5)
            _check_state(K, V, ks, vs, spos, layout, tables[i], st, budgets, packed, t + 1, f"request {i} step {t}")
            done[i] += 1


@pytest.mark.parametrize("budgets,bs", [((13,) * HKV, 4), ((9, 17, 13), 8)], ids=["uniform", "packed"])
def test_prompt_and_chunk_against_float_slots(budgets, bs):
    """A prompt (ctx 0) and a later chunk: the output equals the float slots' ``extend`` on the dequantised cache,
    the kept positions are the same, a chunk token is stored as its own codes and scales, a cached token keeps its
    bytes and scales (moved, never requantised); then decode steps continue as the reference's."""
    torch.manual_seed(3)
    packed = len(set(budgets)) > 1
    rows = HKV
    layout = PackedSlots(budgets, rows) if packed else UniformSlots(budgets[0], HKV)
    per_req = -(-sum(budgets) // (rows * bs)) if packed else -(-budgets[0] // bs)
    num_blocks = per_req + 3
    K, V, ks, vs, spos, sprio = _paged(num_blocks, rows, bs, seed=4)
    table = torch.randperm(num_blocks)[:per_req].to(torch.int32)
    n0, n1, n2 = 11, 19, 12
    n = n0 + n1 + n2
    q, k, v, p = torch.randn(n, HQ, D), torch.randn(n, HKV, D) * 3, torch.randn(n, HKV, D), torch.randn(n, HKV)
    kw = dict(sinks=S, window=W, scale=D ** -0.5, layout=layout)
    ctx = 0
    for L in (n0, n1):
        sl = slice(ctx, ctx + L)
        # the float slots' oracle: the same cache dequantised, same side tables
        Kf, Vf = torch.zeros(*K.shape), torch.zeros(*V.shape)
        Kf.copy_(K.view(FP8).float() * ks[..., None])
        Vf.copy_(V.view(FP8).float() * vs[..., None])
        spf, prf = spos.clone(), sprio.clone()
        want = extend(Kf, Vf, spf, prf, table, ctx, q[sl], k[sl], v[sl], p[sl], **kw)
        old = {}
        for h, b in enumerate(layout.budgets):
            m = min(ctx, b)
            ck, cv, cpos, _ = gather_slots(K, V, spos, sprio, table, m, bs, layout=layout, heads=torch.tensor([h]))
            cks, cvs, _, _ = gather_slots(ks[..., None], vs[..., None], spos, sprio, table, m, bs, layout=layout,
                                          heads=torch.tensor([h]))
            for i, t in enumerate(cpos[0].tolist()):
                old[h, t] = (ck[0, i], cv[0, i], cks[0, i, 0], cvs[0, i, 0])
        got = quantized.extend(K, V, ks, vs, spos, sprio, table, ctx, q[sl], k[sl], v[sl], p[sl], **kw)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        ctx += L
        kq, kscale = quantize(k[:ctx], "fp8")
        vq, vscale = quantize(v[:ctx], "fp8")
        for h, b in enumerate(layout.budgets):
            m = min(ctx, b)
            gk, gv, gpos, gprio = gather_slots(K, V, spos, sprio, table, m, bs, layout=layout, heads=torch.tensor([h]))
            gks, gvs, _, _ = gather_slots(ks[..., None], vs[..., None], spos, sprio, table, m, bs, layout=layout,
                                          heads=torch.tensor([h]))
            _, _, fpos, fprio = gather_slots(Kf, Vf, spf, prf, table, m, bs, layout=layout, heads=torch.tensor([h]))
            assert torch.equal(gpos, fpos) and torch.equal(gprio, fprio), f"head {h}: kept set after {ctx}"
            for i, t in enumerate(gpos[0].tolist()):
                if t >= ctx - L:  # a chunk token: its own codes
                    assert torch.equal(gk[0, i], kq[t, h].view(torch.uint8)) and gks[0, i, 0] == kscale[t, h]
                    assert torch.equal(gv[0, i], vq[t, h].view(torch.uint8)) and gvs[0, i, 0] == vscale[t, h]
                else:  # a cached token: the bytes and scales it had
                    ok, ov, oks, ovs = old[h, t]
                    assert torch.equal(gk[0, i], ok) and torch.equal(gv[0, i], ov) and gks[0, i, 0] == oks
                    assert gvs[0, i, 0] == ovs, f"head {h} token {t}"
    # decode steps from here against the reference, started from the stored state
    st = _ref_state(budgets, packed)
    for h, (rk, rv, rks, rvs, rpos) in enumerate(_ref_slots(st, budgets, packed)):
        m = min(ctx, budgets[h])
        gk, gv, gpos, _ = gather_slots(K, V, spos, sprio, table, m, bs, layout=layout, heads=torch.tensor([h]))
        gks, gvs, _, _ = gather_slots(ks[..., None], vs[..., None], spos, sprio, table, m, bs, layout=layout,
                                      heads=torch.tensor([h]))
        rk[:m], rv[:m] = gk[0].view(FP8), gv[0].view(FP8)
        rks[:m], rvs[:m], rpos[:m] = gks[0, :, 0], gvs[0, :, 0], gpos[0]
    off = koff = 0
    for h, b in enumerate(budgets):  # the reference's long-range priorities
        kh = b - S - W
        _, _, gpos, gprio = gather_slots(K, V, spos, sprio, table, min(ctx, b), bs, layout=layout,
                                         heads=torch.tensor([h]))
        lrp = gprio[0, S + W:]
        (st["prio"][koff:koff + lrp.numel()] if packed else st["prio"][h, :lrp.numel()]).copy_(lrp)
        off, koff = off + b, koff + kh
    for t in range(ctx, n):
        quantized.decode_step(K, V, ks, vs, spos, sprio, table[None], torch.tensor([t]), k[t][None], v[t][None],
                              p[t][None], sinks=S, window=W, layout=layout)
        out = quantized.decode_attention(K, V, ks, vs, table[None], torch.tensor([t]), q[t][None], layout=layout,
                                         scale=D ** -0.5)
        want, _ = reference.quantized_fixed_budget_decode(
            q[t], k[t], v[t], st["k"], st["v"], st["ks"], st["vs"], st["pos"], st["prio"], p[t - W], pos=t, sinks=S,
            window=W, kv_dtype="fp8", scale=D ** -0.5, head_budgets=budgets if packed else None)
        torch.testing.assert_close(out[0], want, atol=1e-5, rtol=1e-5, msg=f"step {t}")
        _check_state(K, V, ks, vs, spos, layout, table, st, budgets, packed, t + 1, f"step {t}")


@pytest.mark.parametrize("given", ["int8", "fp8_e5m2", "int4_per_token_head", "bfloat16", None])
def test_unsupported_cache_dtype_refused_by_name(given):
    with pytest.raises(ValueError, match=r"kv_cache_dtype in \['auto', 'fp8', 'fp8_e4m3', 'int8_per_token_head', "
                                         r"'fp8_per_token_head'\].*got " + repr(given)):
        quantized.kv_dtype_of(given)


def test_cache_dtypes_taken():
    assert quantized.kv_dtype_of("auto") is None
    assert quantized.kv_dtype_of("fp8") == quantized.kv_dtype_of("fp8_e4m3") == "fp8"
    assert quantized.kv_dtype_of("fp8_per_token_head") == "fp8"
    assert quantized.kv_dtype_of("int8_per_token_head") == "int8"
    assert quantized.check_cache_dtype("fp8", cpu=True) == "fp8"
    assert quantized.check_cache_dtype("int8_per_token_head", cpu=False) == "int8"
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8' on the CPU backend only"):
        quantized.check_cache_dtype("fp8", cpu=False)


@pytest.mark.parametrize("cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_page_views_are_vllms(cache_dtype):
    """kvpop's views of a per-token-head page read what vLLM's Triton backend's own views write (codes, then the
    float32 scale, for the key and then the value of each slot and row), and the spec vLLM sizes the page with
    counts ``2 * (D + 4)`` bytes per slot and row."""
    pytest.importorskip("vllm.v1.attention.backends.triton_attn")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from kvpop.vllm.backends import KVpopCPUBackend

    quantized.check_page_views.cache_clear()
    quantized.check_page_views(4, 32, 32, cache_dtype)
    dtype = torch.int8 if cache_dtype.startswith("int8") else torch.uint8
    spec = KVpopCPUBackend.customize_spec(FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=32, dtype=dtype,
                                                            kv_quant_mode=get_kv_quant_mode(cache_dtype)))
    assert spec.page_size_bytes == 4 * 32 * 2 * (32 + 4)
    with pytest.raises(ValueError, match="2 \\* \\(head_size \\+ 4\\) bytes per slot"):
        quantized.page_views(torch.zeros(2, 4, 32, 64, dtype=dtype), 32)


def test_cpu_block_layout_is_vllms_fp8():
    """vLLM's own fp8 cache write (scale 1) of exactly representable values stores float8 e4m3fn bytes, keys
    ``[D, bs]`` and values ``[bs, D]`` per block on this CPU: where and as kvpop writes its codes."""
    pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, 32, 32, "fp8")
    assert quantized.cpu_block_layout(isa, 32, 32) == (True, False)

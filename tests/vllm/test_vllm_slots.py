"""``kvpop.vllm.slots``: many requests' fixed-budget caches inside one paged cache (no vLLM needed).

Oracle: one ``sparse_attention`` forward over each request's whole sequence with the same priorities
(DESIGN.md: prefill + fixed-budget decoding == one teacher-forced sparse forward), and the set the
schedule keeps at the last position.  Requests are fed in random interleavings of prompts, later
chunks and batched decode steps, through shuffled block tables, keys stored in both layouts.
"""
import random

import pytest
import torch

from kvpop.vllm.slots import PackedSlots, UniformSlots, decode_attention, decode_step, extend, gather_slots
from kvpop_kernels import eviction_schedule, reference, sparse_attention

D, HQ, HKV = 8, 4, 2


@pytest.fixture(autouse=True)
def _pytorch_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels are tested on their own; this is the slot logic


def _paged(num_blocks, bs, transposed, rows=HKV):
    """Logical [nb, rows, bs, D] views of a physical cache (keys stored [D, bs] per block when transposed)."""
    if transposed:
        K = torch.zeros(num_blocks, rows, D, bs).transpose(2, 3)
    else:
        K = torch.zeros(num_blocks, rows, bs, D)
    V = torch.zeros(num_blocks, rows, bs, D)
    # stale garbage everywhere: a correct implementation never reads a slot it did not write
    K.normal_(), V.normal_()
    pos = torch.randint(-5, 1000, (num_blocks, rows, bs), dtype=torch.int32)
    prio = torch.randn(num_blocks, rows, bs) * 100
    return K, V, pos, prio


def _run(seqs, s, w, B, bs, transposed, seed, layouts=None):
    """Feed ``seqs`` (one dict of q, k, v, p per layer, in ``x["layers"]``) through the slots of ``layouts`` (one per
    layer, all in one paged cache; uniform budget ``B`` when None) in a random interleaving."""
    rng = random.Random(seed)
    if layouts is None:
        layouts, rows, nblk = [None], HKV, -(-B // bs)
    else:
        rows = layouts[0].rows
        nblk = -(-(layouts[-1].base + layouts[-1].span) // (rows * bs))
    num_blocks = nblk * len(seqs) + 3
    K, V, spos, sprio = _paged(num_blocks, bs, transposed, rows)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = [torch.tensor(perm[i * nblk:(i + 1) * nblk] + [perm[-1]], dtype=torch.int32) for i in range(len(seqs))]
    done = [0] * len(seqs)
    length = [x["layers"][0]["q"].shape[0] for x in seqs]
    outs = [[torch.zeros(n, HQ, D) for _ in layouts] for n in length]
    scale = D ** -0.5
    kw = [dict(budget=B) if lay is None else dict(layout=lay) for lay in layouts]
    while any(d < n for d, n in zip(done, length)):
        live = [i for i in range(len(seqs)) if done[i] < length[i]]
        dec = [i for i in live if done[i] > 0 and rng.random() < 0.6]
        if dec:  # one batched decode step for these requests, every layer
            idx = torch.tensor([done[i] for i in dec])
            bt = torch.stack([tables[i] for i in dec])
            for li, lay in enumerate(layouts):
                x = [seqs[i]["layers"][li] for i in dec]
                kn, vn, pn, qn = (torch.stack([xi[f][done[i]] for xi, i in zip(x, dec)]) for f in "kvpq")
                decode_step(K, V, spos, sprio, bt, idx, kn, vn, pn, sinks=s, window=w, **kw[li])
                if lay is not None:
                    att = decode_attention(K, V, bt, idx, qn, layout=lay, scale=scale)
                for r, i in enumerate(dec):
                    if lay is not None:
                        outs[i][li][done[i]] = att[r]
                        continue
                    n = min(done[i] + 1, B)  # attention over the first min(n, B) slots, as a paged kernel would
                    ck, cv, _, _ = gather_slots(K, V, spos, sprio, tables[i], n, bs)
                    rep = HQ // HKV
                    a = torch.softmax(torch.einsum("hd,hnd->hn", qn[r], ck.repeat_interleave(rep, 0)) * scale, -1)
                    outs[i][li][done[i]] = torch.einsum("hn,hnd->hd", a, cv.repeat_interleave(rep, 0))
            for i in dec:
                done[i] += 1
        rest = [i for i in live if i not in dec]
        for i in rest:  # a prompt or a later chunk
            L = min(rng.choice([1, 2, 5, w - 1, w + 3, 3 * max(B or 0, 8)]), length[i] - done[i])
            a = done[i]
            for li in range(len(layouts)):
                x = seqs[i]["layers"][li]
                outs[i][li][a:a + L] = extend(K, V, spos, sprio, tables[i], a, x["q"][a:a + L], x["k"][a:a + L],
                                              x["v"][a:a + L], x["p"][a:a + L], sinks=s, window=w, scale=scale,
                                              **kw[li])
            done[i] += L
    return outs, (K, V, spos, sprio, tables, bs)


def _seqs(lengths, n_layers, ties):
    out = []
    for S in lengths:
        layers = []
        for _ in range(n_layers):
            prio = torch.randint(0, 3, (S, HKV)).float() if ties else torch.randn(S, HKV)
            layers.append({"q": torch.randn(S, HQ, D), "k": torch.randn(S, HKV, D), "v": torch.randn(S, HKV, D),
                           "p": prio})
        out.append({"layers": layers})
    return out


def _check(seqs, outs, state, s, w, layouts):
    """Each layer's outputs == one sparse forward with its heads' own k; the slots hold the kept set."""
    K, V, spos, sprio, tables, bs = state
    for x, out, table in zip(seqs, outs, tables):
        for li, lay in enumerate(layouts):
            xl = x["layers"][li]
            S = xl["q"].shape[0]
            ks = [b - s - w for b in lay.budgets]
            ev = eviction_schedule(xl["p"].T[None].contiguous(), sinks=s, window=w, k=ks)
            ref, _ = sparse_attention(xl["q"].transpose(0, 1)[None], xl["k"].transpose(0, 1)[None],
                                      xl["v"].transpose(0, 1)[None], ev, sinks=s, window=w)
            torch.testing.assert_close(out[li], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
            vis = reference.visible_mask(ev, sinks=s, window=w)[0, :, S - 1]  # [Hkv, S]
            for h, b in enumerate(lay.budgets):
                n = min(S, b)
                ck, cv, cpos, cprio = (t[0] for t in gather_slots(K, V, spos, sprio, table, n, bs, layout=lay,
                                                                   heads=torch.tensor([h])))
                assert sorted(cpos.tolist()) == vis[h].nonzero().flatten().tolist()
                t = cpos.long()
                torch.testing.assert_close(ck, xl["k"][t, h])
                torch.testing.assert_close(cv, xl["v"][t, h])
                lr = t >= s
                torch.testing.assert_close(cprio[lr], xl["p"][t[lr], h])


@pytest.mark.parametrize("s,w,B,bs,transposed,ties", [
    (4, 8, 20, 32, False, False),  # the budget inside one block
    (2, 5, 16, 4, True, True),     # four blocks, keys stored [D, bs], tied priorities
    (0, 3, 9, 4, False, True),     # no sinks, a budget that ends inside a block
    (4, 8, 13, 8, True, False),
    (1, 4, 5, 2, False, False),    # k = 0: sinks + window only
])
def test_matches_one_sparse_forward(s, w, B, bs, transposed, ties):
    torch.manual_seed(hash((s, w, B, bs, transposed, ties)) % 1000)
    seqs = _seqs((1, 7, 29, 61), 1, ties)
    outs, state = _run(seqs, s, w, B, bs, transposed, seed=B + bs)
    _check(seqs, outs, state, s, w, [UniformSlots(B, HKV)])


@pytest.mark.parametrize("aligned", [False, True], ids=["slot-to-slot", "heads-start-rows"])
@pytest.mark.parametrize("s,w,budgets,bs,transposed,ties", [
    # two layers of two KV heads in pages of 4 rows: layer totals 24 and 16 (mean 10), heads straddle pages
    (2, 5, ((9, 15), (7, 9)), 4, True, False),
    (4, 8, ((12, 28), (20, 20)), 8, False, True),  # a head with no long-range slot; two equal heads
    (0, 3, ((4, 11), (9, 6)), 2, False, True),     # no sinks, small blocks
])
def test_packed_matches_one_sparse_forward(s, w, budgets, bs, transposed, ties, aligned):
    """Head-adaptive budgets, the layers of a model packed one after another into shared pages (the
    plugin's layout; packed slot to slot, or each head from a row's first slot as the CPU backend packs an
    unquantised cache): every layer equals one sparse forward with each head's own k, its slots hold the
    kept set, and no layer or head writes into another's slots."""
    torch.manual_seed(hash((s, w, budgets, bs)) % 1000)
    rows = 2 * HKV
    layouts, base = [], 0
    for b in budgets:
        layouts.append(PackedSlots(b, rows, base, align=bs if aligned else 1))
        base += layouts[-1].span
    assert all(lay.starts_rows(bs) for lay in layouts) == aligned
    seqs = _seqs((1, 7, 29, 61), len(budgets), ties)
    outs, state = _run(seqs, s, w, None, bs, transposed, seed=bs, layouts=layouts)
    _check(seqs, outs, state, s, w, layouts)


def test_decode_step_matches_reference_step():
    """Batched decode_step == kvpop_kernels.reference.fixed_budget_decode, request by request."""
    torch.manual_seed(1)
    s, w, B, bs = 2, 3, 9, 4
    N = 3
    K, V, spos, sprio = _paged(12, bs, transposed=True)
    bt = torch.tensor([[5, 0, 9], [1, 11, 3], [7, 2, 6]], dtype=torch.int32)
    ref = [dict(k=torch.zeros(HKV, B, D), v=torch.zeros(HKV, B, D), pos=torch.full((HKV, B), -1, dtype=torch.int32),
                prio=torch.full((HKV, B - s - w), float("-inf")), ring=torch.zeros(HKV, w)) for _ in range(N)]
    for pos in range(30):
        kn, vn, pn = torch.randn(N, HKV, D), torch.randn(N, HKV, D), torch.randint(0, 4, (N, HKV)).float()
        decode_step(K, V, spos, sprio, bt, torch.full((N,), pos), kn, vn, pn, sinks=s, window=w, budget=B)
        for r in range(N):
            c = ref[r]
            ring = s + (pos - s) % w if pos >= s else None
            leaving = c["ring"][:, ring - s].clone() if ring is not None else torch.zeros(HKV)
            reference.fixed_budget_decode(torch.randn(HQ, D), kn[r], vn[r], c["k"], c["v"], c["pos"], c["prio"],
                                          leaving, pos=pos, sinks=s, window=w)
            if ring is not None:
                c["ring"][:, ring - s] = pn[r]
            n = min(pos + 1, B)
            ck, cv, cpos, cprio = gather_slots(K, V, spos, sprio, bt[r], n, bs)
            torch.testing.assert_close(ck, c["k"][:, :n])
            torch.testing.assert_close(cv, c["v"][:, :n])
            assert torch.equal(cpos, c["pos"][:, :n])
            torch.testing.assert_close(cprio[:, s + w:], c["prio"][:, : max(0, n - s - w)])


def test_decode_step_writes_only_owned_slots():
    """A request early in its sequence (``pos < s + w``: its leaving token is no long-range candidate) writes only
    the slots it owns, ``[0, pos + 1)``: its block-table columns past its allocation are stale in vLLM (a row is
    reused without being cleared) and here name the block into which another request, later in the same batch,
    moves its leaving token in the same step; that move survives.  A padded row (``valid`` False, its row naming
    live blocks) touches block 0 only.  Oracle: the same step of the live request alone.  (Uniform budgets: a packed
    request holds its whole block from its first token, so its table has no stale column.)"""
    torch.manual_seed(3)
    s, w, bs = 2, 4, 4
    layout = UniformSlots(12, HKV)
    K, V, spos, sprio = _paged(10, bs, transposed=False)
    prio_b = torch.randn(HKV) + 50  # B's leaving token outranks the empty slot: it moves to slot s + w
    # B at pos s + w = 6 moves its token 2 into slot 6 (block-table column 1)
    B_row = torch.tensor([3, 7, 5, 8], dtype=torch.int32)
    A_row = torch.tensor([4, 7, 5, 8], dtype=torch.int32)  # A (pos 0) owns column 0; the rest name B's blocks
    sprio[:, :, :] = float("-inf")
    spos[:, :, :] = -1
    # B's cache holds tokens [0, 6); its ring slot of token 2 (slot s + (2 - s) % w = 2) carries priority prio_b
    heads = torch.arange(HKV)
    blk, row, off = layout.addr(B_row[None], heads[None, :, None].expand(1, HKV, 6), torch.arange(6)[None, None].expand(
        1, HKV, 6), bs)
    spos[blk, row, off] = torch.arange(6, dtype=torch.int32)[None, None].expand(1, HKV, 6)
    sprio[blk, row, off] = prio_b[None, :, None].expand(1, HKV, 6)
    kw = dict(sinks=s, window=w, layout=layout)
    new = [torch.randn(3, HKV, D) for _ in range(2)] + [torch.randn(3, HKV)]
    alone = [t.clone() for t in (K, V, spos, sprio)]
    decode_step(*alone, B_row[None], torch.tensor([6]), new[0][:1], new[1][:1], new[2][:1], **kw)
    table = torch.stack([B_row, A_row, A_row])  # B, then A, then a padded row naming B's blocks
    valid = torch.tensor([True, True, False])
    decode_step(K, V, spos, sprio, table, torch.tensor([6, 0, 3]), *new, valid=valid, **kw)
    a_own = layout.addr(A_row[None], heads[None, :, None], torch.zeros(1, HKV, 1, dtype=torch.long), bs)
    for got, want in zip((K, V, spos, sprio), alone):
        diff = (got != want).reshape(got.shape[0], got.shape[1], bs, -1).any(-1)  # [nb, rows, bs]
        diff[a_own] = False  # A's own slot 0 holds A's token
        diff[0] = False  # the null block: the padded row's
        assert not diff.any(), f"writes outside the rows' own slots at {diff.nonzero().tolist()}"


@pytest.mark.parametrize("kind", ["contiguous", "transposed", "page rows", "odd rows", "side table", "page scales"])
def test_linear_access_equals_the_advanced_index(kind):
    """``slots._Flat`` (one linear ``index_select`` / ``index_copy_``) reads and writes what advanced indexing with
    the three address tensors does, on every view the backends hand it: contiguous and transposed slots, a page
    whose rows hold codes and scales side by side (overlapping rows: writes by address), side tables and the
    scales' strided view."""
    from kvpop.vllm.slots import _Flat

    torch.manual_seed(0)
    nb, rows, bs = 5, 3, 4
    if kind == "contiguous":
        x = torch.randn(nb, rows, bs, D)
    elif kind == "transposed":
        x = torch.randn(nb, rows, D, bs).transpose(2, 3)
    elif kind == "page rows":  # [K codes D | scale 1 | V codes D | scale 1] per slot, as a per-token-head page
        x = torch.randn(nb, rows, bs, 2 * D + 2)[..., :D]
    elif kind == "odd rows":  # rows of D every D + 1, pages one longer: rows start at any element (they overlap)
        n = bs * (D + 1) + 1
        x = torch.randn(nb * rows * n).as_strided((nb, rows, bs, D), (rows * n, n, D + 1, 1))
    elif kind == "side table":
        x = torch.randn(nb, rows, bs)
    else:
        x = torch.randn(nb, rows, bs, 2 * D + 2)[..., D]
    f = _Flat(x)
    assert (f.units is None) == (kind == "transposed") and f.overlap == (kind == "odd rows")
    at = (torch.randint(0, nb, (6, 2)), torch.randint(0, rows, (6, 2)), torch.randint(0, bs, (6, 2)))
    assert torch.equal(f.get(f.index(at)), x[at])
    uniq = (torch.tensor([[0, 1], [4, 2]]), torch.tensor([[2, 0], [1, 1]]), torch.tensor([[3, 3], [0, 1]]))
    new = torch.randn(*uniq[0].shape, *x.shape[3:])
    want = x.clone()
    want[uniq] = new
    f.put(f.index(uniq) if f.writes_linear else uniq, new)
    assert torch.equal(x, want)


@pytest.mark.parametrize("kind", ["contiguous", "transposed", "page rows", "odd rows", "side table"])
def test_chunk_view_reads_whole_block_rows(kind):
    """``slots._chunk_view``: one ``index_select`` of chunk ``(block, row)`` is ``x[block, row]`` (its ``bs`` slots)
    on every view the backends hand ``decode_attention``."""
    from kvpop.vllm.slots import _chunk_view

    torch.manual_seed(1)
    nb, rows, bs = 5, 3, 4
    x = {"contiguous": lambda: torch.randn(nb, rows, bs, D),
         "transposed": lambda: torch.randn(nb, rows, D, bs).transpose(2, 3),
         "page rows": lambda: torch.randn(nb, rows, bs, 2 * D + 2)[..., :D],
         "odd rows": lambda: torch.randn(nb * rows * (bs * (D + 1) + 1)).as_strided(
             (nb, rows, bs, D), (rows * (bs * (D + 1) + 1), bs * (D + 1) + 1, D + 1, 1)),
         "side table": lambda: torch.randn(nb, rows, bs)}[kind]()
    view, (u0, u1) = _chunk_view(x)
    blk, row = torch.tensor([4, 0, 2, 4]), torch.tensor([2, 1, 0, 2])
    got = view.index_select(0, blk * u0 + row * u1).view(4, *x.shape[2:])
    assert torch.equal(got, x[blk, row])


@pytest.mark.parametrize("layout", [UniformSlots(13, 3), PackedSlots((5, 17, 3), 4, 0), PackedSlots((9, 2, 30), 4, 25)])
def test_runs_put_each_slot_where_the_layout_does(layout):
    """``slots._runs``: head ``h``'s slot ``j`` is at position ``lo_h + j`` of its chunks laid end to end, and that
    position of that chunk is the layout's address of the slot; positions that are not its slots are marked."""
    from kvpop.vllm.slots import _runs

    bs = 4
    (col, row, _, _), slot = _runs(layout, bs, torch.device("cpu"))
    table = torch.randperm(40)[None]  # one request's pages, shuffled
    for h, b in enumerate(layout.budgets):
        j = torch.arange(b)
        blk, r, off = layout.addr(table, torch.full((1, b), h), j[None], bs)
        p = (slot[h] < 2**31 - 1).nonzero().flatten()
        assert torch.equal(slot[h, p], j)  # every slot once, in order, at consecutive positions
        chunk = p // bs
        assert torch.equal(table[0, col[h, chunk]], blk[0]) and torch.equal(row[h, chunk], r[0])
        assert torch.equal(p % bs, off[0])


@pytest.mark.parametrize("budgets,base,bs", [((5, 17, 3), 0, 4), ((9, 2, 30), 32, 8), ((1, 16, 7), 4, 1)])
def test_row_sequences_are_each_heads_occupied_slots(budgets, base, bs):
    """``slots.row_sequences`` on a layout whose heads start rows: sequence ``(request, head)``'s first ``seq_len``
    positions, read block by block from the cache viewed as blocks of one row, are the head's slots ``0 ..
    min(pos + 1, B_h) - 1`` where the layout puts them; a layout packed slot to slot is refused by name."""
    from kvpop.vllm.slots import row_sequences

    torch.manual_seed(3)
    rows, n = 4, 3
    lay = PackedSlots(budgets, rows, base, align=bs)
    assert lay.starts_rows(bs) and lay.offsets[1] % bs == 0 and lay.span == sum(-(-b // bs) * bs for b in budgets)
    pages = -(-(base + lay.span) // (rows * bs))
    x = torch.randn(n * pages + 2, rows, bs)  # one number per slot: where a sequence's position reads from
    table = torch.randperm(x.shape[0])[: n * pages].view(n, pages)
    pos = torch.tensor([0, 6, 40])
    seq_table, seen = row_sequences(table.int(), pos, layout=lay, bs=bs)
    assert seq_table.dtype == torch.int32 and seen.dtype == torch.int32
    blocks = x.view(-1, bs)  # [num_blocks * rows, bs]: row r of block b is block b * rows + r
    for i in range(n):
        for h, b in enumerate(budgets):
            m = min(int(pos[i]) + 1, b)
            assert int(seen[i * len(budgets) + h]) == m
            got = blocks[seq_table[i * len(budgets) + h].long()].reshape(-1)[:m]
            blk, r, off = lay.addr(table[i:i + 1], torch.full((1, m), h), torch.arange(m)[None], bs)
            assert torch.equal(got, x[blk[0], r[0], off[0]])
    with pytest.raises(ValueError, match=r"start a row of 4 slots.*align=1"):
        row_sequences(table.int(), pos, layout=PackedSlots((5, 17, 3), rows, 0), bs=4)
    with pytest.raises(ValueError, match="align must be a positive number of slots, got 0"):
        PackedSlots((5, 17), rows, 0, align=0)

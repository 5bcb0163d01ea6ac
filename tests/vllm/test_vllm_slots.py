"""``kvpop.vllm.slots``: many requests' fixed-budget caches inside one paged cache (no vLLM needed).

Oracle: one ``sparse_attention`` forward over each request's whole sequence with the same priorities
(DESIGN.md: prefill + fixed-budget decoding == one teacher-forced sparse forward), and the set the
schedule keeps at the last position.  Requests are fed in random interleavings of prompts, later
chunks and batched decode steps, through shuffled block tables, keys stored in both layouts.
"""
import random

import pytest
import torch

from kvpop.vllm.slots import decode_step, extend, gather_slots
from kvpop_kernels import eviction_schedule, reference, sparse_attention

D, HQ, HKV = 8, 4, 2


@pytest.fixture(autouse=True)
def _pytorch_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels are tested on their own; this is the slot logic


def _paged(num_blocks, bs, transposed):
    """Logical [nb, Hkv, bs, D] views of a physical cache (keys stored [D, bs] per block when transposed)."""
    if transposed:
        K = torch.zeros(num_blocks, HKV, D, bs).transpose(2, 3)
    else:
        K = torch.zeros(num_blocks, HKV, bs, D)
    V = torch.zeros(num_blocks, HKV, bs, D)
    # stale garbage everywhere: a correct implementation never reads a slot it did not write
    K.normal_(), V.normal_()
    pos = torch.randint(-5, 1000, (num_blocks, HKV, bs), dtype=torch.int32)
    prio = torch.randn(num_blocks, HKV, bs) * 100
    return K, V, pos, prio


def _run(seqs, s, w, B, bs, transposed, seed):
    rng = random.Random(seed)
    nblk = -(-B // bs)
    num_blocks = nblk * len(seqs) + 3
    K, V, spos, sprio = _paged(num_blocks, bs, transposed)
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables = [torch.tensor(perm[i * nblk:(i + 1) * nblk] + [perm[-1]], dtype=torch.int32) for i in range(len(seqs))]
    done = [0] * len(seqs)
    outs = [torch.zeros(x["q"].shape[0], HQ, D) for x in seqs]
    scale = D ** -0.5
    while any(d < x["q"].shape[0] for d, x in zip(done, seqs)):
        live = [i for i, x in enumerate(seqs) if done[i] < x["q"].shape[0]]
        dec = [i for i in live if done[i] > 0 and rng.random() < 0.6]
        if dec:  # one batched decode step for these requests
            idx = torch.tensor([done[i] for i in dec])
            bt = torch.stack([tables[i] for i in dec])
            kn = torch.stack([seqs[i]["k"][done[i]] for i in dec])
            vn = torch.stack([seqs[i]["v"][done[i]] for i in dec])
            pn = torch.stack([seqs[i]["p"][done[i]] for i in dec])
            decode_step(K, V, spos, sprio, bt, idx, kn, vn, pn, sinks=s, window=w, budget=B)
            for i in dec:  # attention over the first min(n, B) slots, as a paged kernel would
                n = min(done[i] + 1, B)
                ck, cv, _, _ = gather_slots(K, V, spos, sprio, tables[i], n, bs)
                q = seqs[i]["q"][done[i]]
                att = torch.softmax(torch.einsum("hd,hnd->hn", q, ck.repeat_interleave(HQ // HKV, 0)) * scale, -1)
                outs[i][done[i]] = torch.einsum("hn,hnd->hd", att, cv.repeat_interleave(HQ // HKV, 0))
                done[i] += 1
        rest = [i for i in live if i not in dec]
        for i in rest:  # a prompt or a later chunk
            L = min(rng.choice([1, 2, 5, w - 1, w + 3, 3 * B]), seqs[i]["q"].shape[0] - done[i])
            a = done[i]
            x = seqs[i]
            outs[i][a:a + L] = extend(K, V, spos, sprio, tables[i], a, x["q"][a:a + L], x["k"][a:a + L],
                                      x["v"][a:a + L], x["p"][a:a + L], sinks=s, window=w, budget=B, scale=scale)
            done[i] += L
    return outs, (K, V, spos, sprio, tables, bs)


@pytest.mark.parametrize("s,w,B,bs,transposed,ties", [
    (4, 8, 20, 32, False, False),  # the budget inside one block
    (2, 5, 16, 4, True, True),     # four blocks, keys stored [D, bs], tied priorities
    (0, 3, 9, 4, False, True),     # no sinks, a budget that ends inside a block
    (4, 8, 13, 8, True, False),
    (1, 4, 5, 2, False, False),    # k = 0: sinks + window only
])
def test_matches_one_sparse_forward(s, w, B, bs, transposed, ties):
    torch.manual_seed(hash((s, w, B, bs, transposed, ties)) % 1000)
    seqs = []
    for S in (1, 7, 29, 61):
        prio = torch.randint(0, 3, (S, HKV)).float() if ties else torch.randn(S, HKV)
        seqs.append({"q": torch.randn(S, HQ, D), "k": torch.randn(S, HKV, D), "v": torch.randn(S, HKV, D), "p": prio})
    outs, (K, V, spos, sprio, tables, bs) = _run(seqs, s, w, B, bs, transposed, seed=B + bs)
    k = B - s - w
    for x, out, table in zip(seqs, outs, tables):
        S = x["q"].shape[0]
        pr = x["p"].T[None].contiguous()
        ev = eviction_schedule(pr, sinks=s, window=w, k=k)
        ref, _ = sparse_attention(x["q"].transpose(0, 1)[None], x["k"].transpose(0, 1)[None],
                                  x["v"].transpose(0, 1)[None], ev, sinks=s, window=w)
        torch.testing.assert_close(out, ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        # the slots hold exactly the kept set of the last query, each token's own key, value and priority
        n = min(S, B)
        ck, cv, cpos, cprio = gather_slots(K, V, spos, sprio, table, n, bs)
        vis = reference.visible_mask(ev, sinks=s, window=w)[0, :, S - 1]  # [Hkv, S]
        for h in range(HKV):
            assert sorted(cpos[h].tolist()) == vis[h].nonzero().flatten().tolist()
            t = cpos[h].long()
            torch.testing.assert_close(ck[h], x["k"][t, h])
            torch.testing.assert_close(cv[h], x["v"][t, h])
            lr = t >= s  # sinks carry no priority that is ever read
            torch.testing.assert_close(cprio[h][lr], x["p"][t[lr], h])


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

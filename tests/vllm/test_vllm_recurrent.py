"""``kvpop.vllm.recurrent``: the mLSTM scorer's priorities through vLLM's chunks and decode steps (no vLLM needed).

Oracle: the transformers cache's computation of the same tokens, ``ScorerHooks.prompt`` (one full-sequence
``MLSTMScorer.forward`` of the prompt) then ``ScorerHooks.leaving`` (``MLSTMScorer.decode_leaving`` per step):
every token's priority when it leaves the window must have the same bits, whatever chunks the prompt is cut
into (boundaries off the mLSTM's 128-token chunks, a single-token prompt), in whatever batch rows it decodes.
"""
import pytest
import torch

from kvpop.core.priority import priority
from kvpop.core.scorers import MLSTMScorer
from kvpop.vllm import recurrent as R

H, D, W = 2, 32, 32


def _scorer(seed=0):
    torch.manual_seed(seed)
    sc = MLSTMScorer(H, D, W, dim=16, hidden=24)
    with torch.no_grad():  # a forget gate that forgets: states that differ would show
        sc.bf.fill_(1.0)
        sc.wi.mul_(100)
    return sc, torch.linspace(-0.01, -0.001, H)


def _oracle(sc, lg, k, v, prompt):
    """Priority of each token ``t < S - w`` when it leaves the window, as the transformers cache computes it."""
    S = k.shape[0]
    kb, vb = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, S, D]
    with torch.no_grad():
        r, state = sc(kb[:, :, :prompt], vb[:, :, :prompt], return_state=True)
    out = {t: p for t, p in enumerate(priority(r, torch.arange(prompt), lg)[0].T[: max(0, prompt - W)])}
    for pos in range(prompt, S):
        t = pos - W
        with torch.no_grad():
            rr = sc.decode_leaving(state, kb[:, :, pos], vb[:, :, pos], torch.tensor([pos]),
                                   kb[:, :, max(t, 0)], vb[:, :, max(t, 0)])
        if t >= 0:
            out[t] = priority(rr, torch.tensor([t]), lg)[0]
    return out


def _served(sc, lg, k, v, chunks, flat):
    """The same through :func:`recurrent.extend_priorities` (the prompt in ``chunks``) and one decode step per
    token after it, the state living in ``flat [1, F']``."""
    out, ctx = {}, 0
    for n in chunks:
        nw = min(W, ctx)
        p = R.extend_priorities(sc, lg, flat, ctx, k[ctx:ctx + n], v[ctx:ctx + n], v[ctx - nw:ctx].transpose(0, 1))
        lo = max(0, ctx - W)
        assert p.shape == (H, max(0, ctx + n - W - lo))
        out.update({lo + i: p[:, i] for i in range(p.shape[1])})
        ctx += n
    for pos in range(ctx, k.shape[0]):
        t = max(pos - W, 0)
        p = R.decode_priorities(sc, lg, flat, torch.tensor([pos]), k[pos][None], v[pos][None], v[t][None])
        if pos >= W:
            out[pos - W] = p[0]
    return out


@pytest.mark.parametrize("chunks", [[270], [96, 96, 60], [1], [7], [40, 1, 1, 150, 33, 26], [128, 128, 4]])
def test_chunks_and_decode_give_the_transformers_bits(chunks):
    sc, lg = _scorer()
    S = 300
    torch.manual_seed(1)
    k, v = torch.randn(S, H, D), torch.randn(S, H, D)
    want = _oracle(sc, lg, k, v, sum(chunks))
    flat = torch.randn(1, R.state_floats(sc) + 5)  # stale garbage of an earlier owner, and a page's tail
    got = _served(sc, lg, k, v, chunks, flat)
    assert sorted(got) == sorted(want) == list(range(S - W))
    bad = [t for t in want if not torch.equal(got[t], want[t])]
    assert not bad, f"{len(bad)} tokens' priorities differ from transformers', first {bad[:5]}"


def test_decode_batch_restarts_at_zero():
    """Three requests decode together, joining at different steps, each starting at position 0 in a state slot
    full of another request's state: each row's priorities equal ``MLSTMScorer.decode_leaving`` on the transformers
    cache's state (``decode_state`` and a ring) of the same rows batched alike.  (Batched alike: on the CPU the
    state carried at a chunk's end has bits that depend on the batch's size, in transformers as here.)"""
    sc, lg = _scorer(2)
    S = 300
    torch.manual_seed(3)
    ks, vs = torch.randn(3, S, H, D), torch.randn(3, S, H, D)
    starts = [0, 130, 250]  # request r decodes positions [0, S - starts[r]) of its own tokens
    flat = torch.randn(3, R.state_floats(sc))
    ref = [(*sc.decode_state(1, "cpu"), torch.zeros(1, H, W, D)) for _ in range(3)]
    checked = 0
    for step in range(S):
        rows = [r for r in range(3) if step >= starts[r]]
        pos = torch.tensor([step - starts[r] for r in rows])
        idx = torch.tensor(rows)
        k = torch.stack([ks[r, step - starts[r]] for r in rows])
        v = torch.stack([vs[r, step - starts[r]] for r in rows])
        t = (pos - W).clamp_min(0)
        vl = torch.stack([vs[r, int(t[i])] for i, r in enumerate(rows)])
        sub = flat[idx].clone()
        got = R.decode_priorities(sc, lg, sub, pos, k, v, vl)
        flat[idx] = sub
        st = [torch.cat([ref[r][i] for r in rows]) for i in range(8)]
        kt = st[7].gather(2, (t % W)[:, None, None, None].expand(-1, H, 1, D)).squeeze(2)
        with torch.no_grad():
            want = priority(sc.decode_leaving(tuple(st[:7]), k, v, pos, kt, vl), t, lg)
        st[7].scatter_(2, (pos % W)[:, None, None, None].expand(-1, H, 1, D), k.unsqueeze(2))
        for i, r in enumerate(rows):
            ref[r] = tuple(x[i:i + 1] for x in st)
            if pos[i] >= W:
                assert torch.equal(got[i], want[i]), f"request {r}, position {int(pos[i])}"
                checked += 1
    assert checked == sum(S - s0 - W for s0 in starts)


def test_state_blocks():
    sc, _ = _scorer()
    F = R.state_floats(sc)
    assert F == H * (16 * 16 + 16 + 1 + 2 * 128 * 16 + 2 * 128 + W * D)
    views = R.unpack(sc, torch.zeros(3, F))
    assert sum(v[0].numel() for v in views) == F and views[-1].shape == (3, H, W, D)
    assert R.state_blocks(sc, 4 * F) == 1 and R.state_blocks(sc, 4 * F - 4) == 2
    with pytest.raises(ValueError, match="page of 6 bytes"):
        R.state_blocks(sc, 6)


def _paged_case(sc, N, P, seed):
    """States of ``N`` rows in shuffled pages of ``P`` floats full of garbage (block 0 never used), and the same
    states as flat rows."""
    g = torch.Generator().manual_seed(seed)
    E = R.state_blocks(sc, 4 * P)
    nb = N * E + 3
    pages = torch.randn(nb, P, generator=g)
    blocks = (torch.randperm(nb - 1, generator=g)[: N * E] + 1).view(N, E).int()
    return pages, blocks, E


@pytest.mark.parametrize("path", ["in_pages", "kernel"])
def test_in_place_decode_equals_the_gathered_one(path):
    """``decode_priorities_in_pages`` (the CPU backend's) gives :func:`decode_priorities`'s bits on the same states
    gathered out of their pages, and leaves the pages as gathering, updating and scattering back would (every
    float, the stale tail of the last page too); ``decode_priorities_kernel`` (the GPU backend's: Triton's
    interpreter here) the same within float32 rounding, with the scorer's own gates (the sharpened input gate of
    ``_scorer`` makes some read-outs' denominators cancel, where float32 sums in another order differ by ~1e-3).
    Four rows start at 0, 70, 120 and 248 in pages of 301 floats (odd: the state's parts straddle pages) and decode
    60 steps (rows 1, 2 and 3 across the 128-token chunk's end; rows 2 and 3 complete their chunks at the same step,
    so that step writes two rows' pages back at once)."""
    sc, lg = _scorer(4)
    if path == "kernel":
        torch.manual_seed(4)
        sc = MLSTMScorer(H, D, W, dim=16, hidden=24)
    N, P = 4, 301
    pages, blocks, E = _paged_case(sc, N, P, 0)
    flat_pages = pages.clone()
    starts = torch.tensor([0, 70, 120, 248])
    fn = R.decode_priorities_in_pages if path == "in_pages" else R.decode_priorities_kernel
    torch.manual_seed(5)
    for step in range(60):
        pos = starts + step
        k, v, vl = torch.randn(N, H, D), torch.randn(N, H, D), torch.randn(N, H, D)
        idx = blocks.long().reshape(-1)
        flat = flat_pages[idx].view(N, -1)
        want = R.decode_priorities(sc, lg, flat, pos, k, v, vl)
        flat_pages[idx] = flat.view(N * E, -1)
        got = fn(sc, lg, pages, blocks, pos, k, v, vl)
        if path == "in_pages":
            assert torch.equal(got, want), f"step {step}"
            assert torch.equal(pages, flat_pages), f"step {step}"
        else:
            live = pos >= W  # the others' priorities are never read
            torch.testing.assert_close(got[live], want[live], atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(pages, flat_pages, atol=2e-5, rtol=2e-5)


def test_kernel_path_padded_rows_write_nowhere():
    """A padded row of a CUDA-graph batch (``valid`` False) handed to ``decode_priorities_kernel`` with the block
    table row of a live request (stale) and the null block: the pages are exactly what the real rows alone make
    of them; its priorities are finite (nobody reads them)."""
    sc, lg = _scorer(6)
    N, P = 2, 301
    pages, blocks, E = _paged_case(sc, N, P, 1)
    ref = pages.clone()
    torch.manual_seed(7)
    pos = torch.tensor([200, 135])
    k, v, vl = torch.randn(N + 2, H, D), torch.randn(N + 2, H, D), torch.randn(N + 2, H, D)
    R.decode_priorities_kernel(sc, lg, ref, blocks, pos, k[:N], v[:N], vl[:N])
    padded = torch.cat([blocks, blocks[:1], torch.zeros(1, E, dtype=blocks.dtype)])
    valid = torch.tensor([True, True, False, False])
    got = R.decode_priorities_kernel(sc, lg, pages, padded, torch.tensor([200, 135, 0, 0]), k, v, vl, valid=valid)
    assert torch.equal(pages, ref)
    assert bool(got.isfinite().all())

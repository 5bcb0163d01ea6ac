"""kvpop.training.train: the loop runs, lowers its losses, and a resumed run repeats the uninterrupted one."""
import pytest
import torch

pytest.importorskip("transformers")
from tiny import SMALL, tiny_model  # noqa: E402

import kvpop  # noqa: E402
from kvpop.training.train import TrainConfig, train  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _data(n=3, B=2, S=48):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (B, S), generator=g) for _ in range(n)]


def _student():
    m = tiny_model()
    return m


def _perturb(m):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_train_lowers_losses():
    m = _student()
    teacher = kvpop.make_teacher(m)
    _perturb(m)
    kvpop.patch(m, **SMALL)
    data = _data(1)
    hist = train(m, data, TrainConfig(steps=12, lr_model=3e-3, lr_scorer=1e-2, progress=False), teacher=teacher)
    assert len(hist) == 12
    assert hist[-1]["kl"] < 0.8 * hist[0]["kl"], [h["kl"] for h in hist]
    assert hist[-1]["score"] < hist[0]["score"], [h["score"] for h in hist]
    for h in hist:
        assert 0.999 <= h["gamma_min"] <= h["gamma_max"] <= 0.999999


def test_resume_repeats_the_next_step(tmp_path):
    cfg = TrainConfig(steps=3, grad_accum=2, lr_model=1e-3, lr_scorer=1e-2, warmup_steps=2, progress=False)
    data = _data(3)

    def fresh():
        m = _student()
        t = kvpop.make_teacher(m)
        _perturb(m)
        torch.manual_seed(11)  # identical scorer init in every run
        return kvpop.patch(m, **SMALL), t

    m_full, t_full = fresh()
    full = train(m_full, data, cfg, teacher=t_full)
    m_a, t_a = fresh()
    train(m_a, data, cfg, teacher=t_a, steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    assert (tmp_path / "last.pt").exists() and (tmp_path / "scorers.safetensors").exists()
    assert not list(tmp_path.glob("*.tmp"))
    m_b, t_b = fresh()
    rest = train(m_b, data, cfg, teacher=t_b, checkpoint_dir=str(tmp_path), resume=True)
    assert [h["step"] for h in rest] == [3]
    for key in ("kl", "score"):
        assert rest[0][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7)
    for (n, p), q in zip(m_full.named_parameters(), m_b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)
    assert kvpop.read_scorer_config(tmp_path / "scorers.safetensors") == kvpop.get_config(m_b)


def test_train_argument_errors():
    with pytest.raises(ValueError, match="patched"):
        train(tiny_model(), _data(1), TrainConfig(steps=1, progress=False))
    with pytest.raises(ValueError, match="grad_accum"):
        TrainConfig(grad_accum=0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainConfig(checkpoint_every=5)


def test_scorer_only_training_leaves_the_model_alone():
    m = kvpop.patch(tiny_model(), **SMALL)
    before = {n: p.detach().clone() for n, p in m.named_parameters() if ".kvpop." not in n}
    hist = train(m, _data(1), TrainConfig(steps=8, lr_scorer=1e-2, train_model=False, progress=False))
    assert all(h["kl"] == 0.0 for h in hist)
    assert hist[-1]["score"] < hist[0]["score"]
    for n, p in m.named_parameters():
        if ".kvpop." not in n:
            assert torch.equal(p, before[n]), n


def _ddp_worker(rank, world, init_file, out_dir, steps):
    import os

    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        m, teacher, data = _ddp_setup()
        cfg = TrainConfig(steps=steps, lr_model=1e-3, lr_scorer=1e-2, progress=False,
                          checkpoint_dir=out_dir, checkpoint_every=steps)
        hist = train(m, data, cfg, teacher=teacher)
        torch.save({"params": {n: p.detach() for n, p in m.named_parameters()}, "hist": hist},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _ddp_setup():
    m = _student()
    teacher = kvpop.make_teacher(m)
    _perturb(m)
    torch.manual_seed(11)
    kvpop.patch(m, balance=False, **SMALL)
    return m, teacher, _data(2)


def test_ddp_two_gloo_processes_match_one_process(tmp_path):
    """Two DDP ranks (gloo, CPU), each with one of two batches, take the same steps as one process on
    both batches at once."""
    import torch.multiprocessing as mp

    steps = 2
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "pg"), str(tmp_path), steps), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    for n in r0["params"]:
        assert torch.equal(r0["params"][n], r1["params"][n]), n
    assert (tmp_path / "last.pt").exists() and (tmp_path / "scorers.safetensors").exists()
    m, teacher, data = _ddp_setup()
    hist = train(m, [torch.cat(data, dim=0)], TrainConfig(steps=steps, lr_model=1e-3, lr_scorer=1e-2,
                                                          progress=False), teacher=teacher)
    for h_ddp, h_one in zip(r0["hist"], hist):
        assert h_ddp["kl"] == pytest.approx(h_one["kl"], rel=1e-4)
        assert h_ddp["score"] == pytest.approx(h_one["score"], rel=1e-4)
    for n, p in m.named_parameters():
        torch.testing.assert_close(r0["params"][n], p.detach(), atol=2e-5, rtol=1e-4, msg=n)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_activation_checkpointing_takes_the_same_steps():
    hists = []
    for ac in (False, True):
        m = _student()
        t = kvpop.make_teacher(m)
        _perturb(m)
        torch.manual_seed(11)
        kvpop.patch(m, **SMALL)
        hists.append(train(m, _data(1), TrainConfig(steps=2, lr_model=1e-3, lr_scorer=1e-2, progress=False,
                                                    activation_checkpointing=ac), teacher=t))
    for a, b in zip(*hists):
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5) and a["score"] == pytest.approx(b["score"], rel=1e-5)
        assert a["score"] > 0

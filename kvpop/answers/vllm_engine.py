"""Generating answers through vLLM with kvpop's plugin (``kvpop eval --problems --engine vllm``,
:class:`VLLMEngine`, called as :func:`kvpop.answers.generation.generate_rows` is)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["VLLM_POLICIES", "VLLMModel", "vllm_overrides", "VLLMEngine"]

VLLM_POLICIES = ("dense", "streaming", "fixed-finetune", "kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint",
                 "kvpop-mlstm-joint")
"""The policies ``--engine vllm`` serves: those of the plugin (``kvpop.vllm``: the ``kvpop`` and ``streaming``
cache policies) and dense (vLLM without the plugin)."""


@dataclass
class VLLMModel:
    """What vLLM serves for one policy: the model directory, the plugin's cache policy (None: dense) and the
    scorer file (for ``kvpop``)."""

    model_dir: str
    cache_policy: str | None = None
    scorers: str | None = None


def vllm_overrides(spec: VLLMModel, *, sinks: int, window: int, budget: int) -> dict:
    """The ``hf_overrides`` that select kvpop's plugin (the ``kvpop_*`` keys of docs/DESIGN.md section 5, as
    ``kvpop.vllm.hf_overrides`` writes them; written here so that ``kvpop.vllm`` stays a leaf: the plugin checks
    them in vLLM's process)."""
    out: dict[str, Any] = {"architectures": ["KVpopQwen3ForCausalLM"], "kvpop_policy": spec.cache_policy,
                           "kvpop_config": {"sinks": sinks, "window": window, "budget": budget}}
    if spec.scorers is not None:
        out["kvpop_scorers"] = spec.scorers
    return out


class VLLMEngine:
    """Answers through vLLM (``LLM.generate``) with kvpop's plugin: one engine per policy and budget, built when
    first needed (the one before it released).  Called as :func:`kvpop.answers.generation.generate_rows`; each
    request samples with its own seed (:func:`kvpop.answers.generation.row_seed`; vLLM's sampler, so sampled
    answers differ from the hf engine's, greedy ones agree).  Cache bytes per sequence are those of the slots
    vLLM pages for the request: ``ceil(n / block_size)`` blocks of keys and values (``n``: the sequence's
    tokens, dense; the budget, kvpop), and with the mLSTM scorer the blocks that hold its state
    (``kvpop.vllm.recurrent.state_blocks``)."""

    def __init__(self, *, sinks: int, window: int, dtype: str = "auto", block_size: int | None = None,
                 max_model_len: int | None = None, **llm_kwargs: Any) -> None:
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise ValueError("--engine vllm needs vLLM installed (pip install vllm; kvpop's plugin is kvpop.vllm); "
                             "use --engine hf") from None
        self.sinks, self.window, self.dtype, self.block_size = sinks, window, dtype, block_size
        self.max_model_len, self.llm_kwargs = max_model_len, llm_kwargs
        self._key: Any = None
        self._llm: Any = None

    def _engine(self, spec: VLLMModel, budget: int | None) -> Any:
        key = (spec.model_dir, spec.cache_policy, spec.scorers, budget)
        if key != self._key:
            self.close()
            from vllm import LLM


            kw: dict[str, Any] = dict(model=spec.model_dir, skip_tokenizer_init=True, dtype=self.dtype,
                                      enable_prefix_caching=False, **self.llm_kwargs)
            if self.block_size is not None:
                kw["block_size"] = self.block_size
            if self.max_model_len is not None:
                kw["max_model_len"] = self.max_model_len
            if spec.cache_policy is not None:
                kw["hf_overrides"] = vllm_overrides(spec, sinks=self.sinks, window=self.window, budget=int(budget))
            self._llm, self._key = LLM(**kw), key
        return self._llm

    def close(self) -> None:
        """Release the current engine."""
        if self._llm is not None:
            import gc

            self._llm, self._key = None, None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def __call__(self, spec: VLLMModel, policy: str, budget: int | None, prompts: Sequence[Sequence[int]],
                 seeds: Sequence[int], *, max_new_tokens: int, temperature: float, top_p: float,
                 eos_token_id: int | list[int] | None, pad_token_id: int) -> list[tuple[list[int], int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._engine(spec, budget)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                 seed=None if temperature == 0 else int(s) % (2**31), ignore_eos=True,
                                 stop_token_ids=eos, detokenize=False) for s in seeds]
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        cfg = llm.llm_engine.model_config
        hf = cfg.hf_text_config
        per_token = (2 * hf.num_hidden_layers * hf.num_key_value_heads * cfg.get_head_size()
                     * torch.tensor([], dtype=cfg.dtype).element_size())
        block = llm.llm_engine.vllm_config.cache_config.block_size
        state = _state_blocks(spec, cfg, block)
        rows = []
        for p, o in zip(prompts, outs):
            toks = list(o.outputs[0].token_ids)
            n = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
            held = budget if spec.cache_policy is not None else len(p) + n - 1
            rows.append((toks[:n], int((-(-held // block) + state) * block * per_token)))
        return rows


def _state_blocks(spec: VLLMModel, cfg, block: int) -> int:
    """Blocks of a request's mLSTM scorer state (0 for another policy): ``MLSTMScorer.state_floats`` float32 values
    per layer over a layer's page, the same count in every layer (``kvpop.vllm.recurrent.state_blocks``, which this
    module does not import: the plugin is a leaf)."""
    if spec.cache_policy != "kvpop" or spec.scorers is None:
        return 0
    from kvpop import read_scorer_config
    from kvpop.core.scorers import build_scorer

    scfg = read_scorer_config(spec.scorers)
    if scfg.scorer != "mlstm":
        return 0
    hf = cfg.hf_text_config
    page = block * hf.num_key_value_heads * 2 * cfg.get_head_size() * torch.tensor([], dtype=cfg.dtype).element_size()
    return -(-4 * build_scorer(scfg, hf.num_key_value_heads, cfg.get_head_size()).state_floats() // page)

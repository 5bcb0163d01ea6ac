"""``KVpopQwen3ForCausalLM``: vLLM's Qwen3 with kvpop scorers and the fixed-budget KV cache.

Selected by the architecture name ``KVpopQwen3ForCausalLM`` (``hf_overrides``, see
:func:`kvpop.vllm.hf_overrides`); the weights are the checkpoint's own Qwen3 weights, the scorers
come from the ``kvpop_scorers`` file (``kvpop.save_scorers``'s format: ``layers.{i}.{name}``).

Per attention layer the priorities of the step's tokens are computed in the model's forward, from the
pre-RoPE key (the ``k_norm`` output) and the value, exactly as ``kvpop.patch`` does in transformers:
``p = r_hat - position * log(gamma_h)`` (zeros for the ``streaming`` policy).  They enter the attention
as an input of one registered custom op (``vllm::kvpop_attention``): handing them over through a
module attribute would be invisible to ``torch.compile``, which would then reorder or drop it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.model_executor.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, extract_layer_index, maybe_prefix
from vllm.platforms import current_platform
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, _resolve_layer_name, direct_register_custom_op

from kvpop import KVpopLayer
from kvpop.core.priority import priority

from .quantized import check_cache_dtype
from .settings import Settings, check_architecture, check_kv_dtype, check_scorer_file, resolve
from .slots import PackedSlots, aligned
from .spec import FixedBudgetSpec

logger = init_logger(f"vllm.{__name__}")  # a child of "vllm": its handler prints it

__all__ = ["KVpopQwen3ForCausalLM", "KVpopAttention", "OP_NAME", "load_scorer_file", "check_engine",
           "KVpopEngineCheck"]

OP_NAME = "vllm::kvpop_attention"


# ------------------------------------------------------------------------------------ the op
@eager_break_during_capture
def kvpop_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prio: torch.Tensor,
                    output: torch.Tensor, layer_name: LayerNameType) -> None:
    """``query [T, Hq, D]``, ``key/value [T, Hkv, D]`` (rotated keys), ``prio [T, Hkv]`` float32 -> ``output``."""
    attn_metadata, layer, kv_cache, _ = get_attention_context(_resolve_layer_name(layer_name))
    layer.impl.kvpop_forward(layer, query, key, value, prio, kv_cache, attn_metadata, output)


def _kvpop_attention_fake(query, key, value, prio, output, layer_name) -> None:
    return None


direct_register_custom_op(op_name="kvpop_attention", op_func=kvpop_attention, mutates_args=["output"],
                          fake_impl=_kvpop_attention_fake)


@eager_break_during_capture
def kvpop_attention_recurrent(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pre: torch.Tensor,
                              output: torch.Tensor, layer_name: LayerNameType) -> None:
    """The mLSTM scorer's op: ``k_pre [T, Hkv, D]`` the pre-RoPE keys; the backend prices each token when it
    leaves the window, from the request's state (``kvpop.vllm.recurrent``) -> ``output``."""
    attn_metadata, layer, kv_cache, _ = get_attention_context(_resolve_layer_name(layer_name))
    layer.impl.kvpop_forward(layer, query, key, value, None, kv_cache, attn_metadata, output, k_pre=k_pre)


direct_register_custom_op(op_name="kvpop_attention_recurrent", op_func=kvpop_attention_recurrent,
                          mutates_args=["output"], fake_impl=_kvpop_attention_fake)


def _backend() -> type:
    from .backends import KVpopCPUBackend, KVpopTritonBackend

    if current_platform.is_cpu():
        return KVpopCPUBackend
    if current_platform.is_cuda_alike():
        return KVpopTritonBackend
    raise NotImplementedError(f"the kvpop vLLM plugin runs on CPU and CUDA platforms, not {current_platform}")


def packed_align(block_size: int | None, kv_cache_dtype: str | None, pack: str | None = None) -> int:
    """Where the packed block starts each head (:class:`PackedSlots` ``align``): at a row's first slot
    (``block_size``) for ``pack="rows"``, and by default on a CPU with an unquantised cache, where the CPU backend
    then attends each packed head with vLLM's own C++ kernel (``KVpopCPUImpl._rows_attention``) for at most
    ``block_size - 1`` more slots a head; slot to slot (1) for ``pack="slots"`` and by default elsewhere (the GPU
    backend's Triton kernel and the 8-bit caches' PyTorch attention read any offset)."""
    if pack == "slots" or not block_size:
        return 1
    if pack == "rows" or (current_platform.is_cpu() and kv_cache_dtype in (None, "auto")):
        return int(block_size)
    return 1


def packed_rows_slots(config, align: int) -> tuple[int, int]:
    """``(rows, slots)`` of the packed block of ``config.head_budgets``: ``L * Hkv`` rows a page, and the packed
    slots every layer's heads take, each head's budget rounded up to ``align``."""
    hb = config.head_budgets
    return sum(len(r) for r in hb), sum(aligned(b, align) for r in hb for b in r)


def packing_summary(config, align: int, block_size: int) -> str:
    """One line on how the packed block of ``config.head_budgets`` is laid out in blocks of ``block_size`` (logged
    at start-up): its slots and blocks a request, and what the other packing would take."""
    rows, packed = packed_rows_slots(config, align)
    _, tight = packed_rows_slots(config, 1)

    def blocks(slots: int) -> str:
        n = -(-slots // (rows * block_size))
        return f"{n} block{'s' if n != 1 else ''}"

    if align == 1:
        return (f"kvpop: head-adaptive budgets packed slot to slot: {packed} slots, {blocks(packed)} of {block_size} "
                f"a request (the uniform cache's bytes)")
    return (f"kvpop: head-adaptive budgets packed with each head from a row (kvpop_pack='rows'): {packed} slots, "
            f"{blocks(packed)} of {block_size} a request; kvpop_pack='slots' takes {tight} slots, {blocks(tight)}")


def packed_layout(settings: Settings, layer_idx: int, num_layers: int, num_kv_heads: int,
                  align: int = 1) -> PackedSlots:
    """Layer ``layer_idx``'s place in the packed block of a head-adaptive model: pages of ``num_layers *
    num_kv_heads`` rows, the layers one after another, each head from a multiple of ``align`` (:func:`packed_align`;
    at ``align = 1`` the block of ``sum_{l,h} B[l][h] = L * Hkv * B`` slots is ``ceil(B / bs)`` pages, those of a
    uniform layer; docs/DESIGN.md section 5)."""
    c = settings.config
    base = sum(aligned(b, align) for i in range(layer_idx) for b in c.layer_budgets(i, num_kv_heads))
    return PackedSlots(c.layer_budgets(layer_idx, num_kv_heads), num_layers * num_kv_heads, base, align)


class KVpopAttention(Attention):
    """vLLM's ``Attention`` with the kvpop backend, a fixed-budget KV-cache spec and a priority input.

    With head-adaptive budgets every layer's heads live in one packed block of layer 0's KV cache (the
    other layers share it through vLLM's cross-layer KV sharing) and ``kvpop_layout`` says where."""

    def __init__(self, *args, settings: Settings, layer_idx: int = 0, num_layers: int = 1, **kwargs) -> None:
        c = settings.config
        self.kvpop_layout = None
        if c.head_budgets is not None:
            prefix = kwargs["prefix"]
            if layer_idx > 0:
                kwargs["kv_sharing_target_layer_name"] = prefix.replace(f".{layer_idx}.", ".0.", 1)
        super().__init__(*args, attn_backend=_backend(), **kwargs)
        self.kvpop_sinks, self.kvpop_window, self.kvpop_budget = c.sinks, c.window, c.budget
        if c.head_budgets is not None:
            cache = kwargs.get("cache_config") or get_current_vllm_config().cache_config
            align = packed_align(cache.block_size, self.kv_cache_dtype, settings.pack)
            self.kvpop_layout = packed_layout(settings, layer_idx, num_layers, self.num_kv_heads, align)
            self.kvpop_packed = packed_rows_slots(c, align)
            self.kvpop_config = c
        self.kvpop_recurrent: tuple = ()
        """``(KVpopLayer,)`` for the mLSTM scorer (a tuple: the layer's parameters stay where the model holds
        them); its state pages sit in front of each request's slots."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                prio: torch.Tensor) -> torch.Tensor:
        output = torch.empty(query.shape[0], self.num_heads * self.head_size_v, dtype=query.dtype,
                             device=query.device)
        if self.kvpop_recurrent:  # prio is the pre-RoPE key: the backend prices tokens as they leave the window
            torch.ops.vllm.kvpop_attention_recurrent(
                query.view(-1, self.num_heads, self.head_size), key.view(-1, self.num_kv_heads, self.head_size),
                value.view(-1, self.num_kv_heads, self.head_size_v), prio,
                output.view(-1, self.num_heads, self.head_size_v), _encode_layer_name(self.layer_name))
            return output
        torch.ops.vllm.kvpop_attention(
            query.view(-1, self.num_heads, self.head_size), key.view(-1, self.num_kv_heads, self.head_size),
            value.view(-1, self.num_kv_heads, self.head_size_v), prio,
            output.view(-1, self.num_heads, self.head_size_v), _encode_layer_name(self.layer_name))
        return output

    def get_kv_cache_spec(self, vllm_config):
        base = super().get_kv_cache_spec(vllm_config)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
        if self.kvpop_layout is None:
            state = kvpop_state_blocks(self, base.page_size_bytes)
            return FixedBudgetSpec(**fields, budget=self.kvpop_budget, state_blocks=state)
        # layer 0 owns the packed block of every layer: pages of L * Hkv rows, ceil(slots / (L * Hkv * bs)) of them
        lay = self.kvpop_layout
        if lay.align > 1 and lay.align != base.block_size:
            raise RuntimeError(f"kvpop: the packed layout starts heads at multiples of {lay.align} slots (the block "
                               f"size when the model was built), but the KV cache's block size is now "
                               f"{base.block_size}; pass block_size= to the engine")
        rows, packed = self.kvpop_packed
        logger.info_once(packing_summary(self.kvpop_config, lay.align, base.block_size))
        fields["num_kv_heads"] = rows
        return FixedBudgetSpec(**fields, budget=-(-packed // rows), whole=True)


class KVpopQwen3Attention(Qwen3Attention):
    """Qwen3 attention that prices each token with the layer's scorer before attending."""

    kvpop: KVpopLayer
    kvpop_settings: Settings

    @classmethod
    def convert(cls, sa: Qwen3Attention, settings: Settings, layer_idx: int, cache_config, quant_config) -> None:
        """Turn a stock ``Qwen3Attention`` into this class in place (its weights are untouched)."""
        stock = sa.attn
        name = stock.layer_name
        # the stock layer registered itself under this name; ours takes the name over
        del get_current_vllm_config().compilation_config.static_forward_context[name]
        sa.__class__ = cls
        sa.attn = KVpopAttention(stock.num_heads, stock.head_size, stock.impl.scale, num_kv_heads=stock.num_kv_heads,
                                 cache_config=cache_config, quant_config=quant_config, prefix=name,
                                 attn_type=stock.attn_type, settings=settings, layer_idx=layer_idx,
                                 num_layers=get_current_vllm_config().model_config.hf_config.num_hidden_layers)
        sa.kvpop_settings = settings
        # scorers stay float32 whatever the model's dtype (as kvpop.patch creates them)
        sa.kvpop = KVpopLayer(settings.config, sa.num_kv_heads, sa.head_dim, layer_idx).float()
        if settings.uses_scorer and settings.config.scorer == "mlstm":  # its cache dtype: check_engine
            sa.attn.kvpop_recurrent = (sa.kvpop,)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        T = q.shape[0]
        q = self.q_norm(q.view(T, -1, self.head_dim)).view(q.shape)
        k_pre = self.k_norm(k.view(T, -1, self.head_dim))  # [T, Hkv, D]: what the scorer reads
        k = k_pre.view(k.shape)
        if self.attn.kvpop_recurrent:  # the mLSTM: priced in the backend, from the request's state
            k_pre = k_pre.clone()  # vLLM's rotary embedding may rotate k, a view of k_pre, in place
            q, k = self.rotary_emb(positions, q, k)
            output, _ = self.o_proj(self.attn(q, k, v, k_pre))
            return output
        if self.kvpop_settings.uses_scorer:
            v_heads = v.view(T, self.num_kv_heads, self.head_dim)
            r = self.kvpop.scorer(k_pre.transpose(0, 1)[None], v_heads.transpose(0, 1)[None])[0]  # [Hkv, T]
            prio = priority(r[None], positions, self.kvpop.log_gamma())[0].transpose(0, 1)
        else:  # streaming: one constant priority, ties keep the newest
            prio = torch.zeros(T, self.num_kv_heads, dtype=torch.float32, device=q.device)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, prio.contiguous())
        output, _ = self.o_proj(out)
        return output


class KVpopQwen3DecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config, cache_config=None, quant_config=None, prefix: str = "", **kwargs) -> None:
        super().__init__(config, cache_config, quant_config, prefix, **kwargs)
        KVpopQwen3Attention.convert(self.self_attn, resolve(config), extract_layer_index(prefix), cache_config,
                                    quant_config)


class KVpopQwen3Model(Qwen3Model):
    decoder_layer_type = KVpopQwen3DecoderLayer


class KVpopQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3 for causal LM served with kvpop's fixed-budget cache (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_config
        self.kvpop_settings = check_engine(vllm_config)  # already checked in the caller's process (KVpopEngineCheck)
        self.config = config
        self.vllm_config = vllm_config
        self.quant_config = vllm_config.quant_config
        self.model = KVpopQwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = AutoWeightsLoader(self).load_weights(weights)
        layers = {name: m for name, m in self.named_modules() if isinstance(m, KVpopLayer)}
        if self.kvpop_settings.scorers is not None:
            loaded |= load_scorer_file(self.kvpop_settings.scorers, layers)
        else:  # streaming: the scorers are never run, their parameters need no values
            loaded |= {f"{name}.{p}" for name, m in layers.items() for p, _ in m.named_parameters()}
        return loaded


def kvpop_state_blocks(attn: KVpopAttention, page_bytes: int) -> int:
    """Pages of the recurrent scorer's state in front of a request's slots (0 without one)."""
    if not attn.kvpop_recurrent:
        return 0
    from .recurrent import state_blocks

    return state_blocks(attn.kvpop_recurrent[0].scorer, page_bytes)


def check_engine(vllm_config) -> Settings:
    """The plugin's settings (:func:`resolve`) once they and the engine's config can serve them: the KV-cache dtype
    (the mLSTM: unquantised, on one device, tensor_parallel_size=1), no prefix caching, no speculative decoding, the
    packed layout's needs; ValueError naming the setting."""
    settings = resolve(vllm_config.model_config.hf_config)
    dtype = vllm_config.cache_config.cache_dtype
    check_cache_dtype(dtype, cpu=current_platform.is_cpu())
    check_kv_dtype(settings, dtype)  # kvpop_config's kv_dtype must be the engine's, never dropped
    if settings.uses_scorer and settings.config.scorer == "mlstm":
        if dtype not in (None, "auto"):
            raise ValueError(f"kvpop serves the mLSTM scorer with unquantised KV caches only (its window values feed "
                             f"the scorer as the transformers cache holds them), got kv_cache_dtype={dtype!r}")
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp > 1:
            raise ValueError(f"kvpop serves the mLSTM scorer with tensor_parallel_size=1 only (its state pages hold "
                             f"every KV head's scorer state of a request, laid out for the model's own KV-head "
                             f"count: a rank holding a share of the heads is not written), got tensor_parallel_size="
                             f"{tp}")
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("kvpop's fixed-budget cache cannot share prefix blocks (their content depends on what "
                         "was evicted): start vLLM with enable_prefix_caching=False / --no-enable-prefix-caching")
    if settings.config.head_budgets is not None:
        _check_packed(vllm_config, settings)
    if vllm_config.speculative_config is not None:
        raise ValueError("kvpop's fixed-budget cache does not support speculative decoding: eviction is "
                         "destructive, so rejected draft tokens could not be rolled back")
    return settings


class KVpopArchitectureCheck(VerifyAndUpdateConfig):
    """The config hook of the architectures vLLM serves itself (``OTHER_ARCHITECTURES``, registered by
    :func:`kvpop.vllm.register` where vLLM has none of its own): kvpop settings on such a model config are refused
    (:func:`kvpop.vllm.settings.check_architecture`), in the caller's process, instead of a dense engine."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        mc = vllm_config.model_config
        check_architecture(mc.hf_config, mc.architecture)


class KVpopEngineCheck(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``, filled by :func:`kvpop.vllm.register`): it runs
    where the engine's config is built, in the caller's process before the engine core starts, so a bad setting
    or scorer file stops ``LLM(...)`` / ``vllm serve`` with its reason, not with "Engine core initialization
    failed" (which is all the caller sees of an error raised in the engine core's process)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        settings = check_engine(vllm_config)
        if settings.scorers is not None:
            check_scorer_file(settings.scorers, vllm_config.model_config.hf_config)


def _check_packed(vllm_config, settings: Settings) -> None:
    """What the packed layout of head-adaptive budgets needs of the engine (ValueError naming the setting)."""
    par = vllm_config.parallel_config
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        raise ValueError(f"kvpop serves head-adaptive budgets on one device (tensor_parallel_size=1, "
                         f"pipeline_parallel_size=1): the packed block holds every layer's and KV head's slots; got "
                         f"tensor_parallel_size={par.tensor_parallel_size}, pipeline_parallel_size="
                         f"{par.pipeline_parallel_size}")
    cache = vllm_config.cache_config
    skip = getattr(cache, "kv_cache_dtype_skip_layers", None)
    if skip and cache.cache_dtype not in (None, "auto"):
        raise ValueError(f"kvpop serves head-adaptive budgets with one KV cache dtype for every layer (all layers' "
                         f"slots share one packed block of kv_cache_dtype={cache.cache_dtype!r}), got "
                         f"kv_cache_dtype_skip_layers={skip!r}: drop it, or quantise no layer")
    # every layer's dtype is the engine's: vLLM resolves "auto" from the checkpoint's quantisation config before
    # this hook, and the skipped layers are refused above
    bs = cache.block_size
    n = vllm_config.model_config.max_model_len
    if bs is None:
        return
    rows, packed = packed_rows_slots(settings.config, packed_align(bs, cache.cache_dtype, settings.pack))
    pages = -(-packed // (rows * bs))
    if pages > -(-n // bs):
        raise ValueError(f"with head-adaptive budgets a request holds its packed block of {pages} blocks from its "
                         f"first token ({packed} slots in pages of {rows} rows of block_size={bs}), more than a "
                         f"request of max_model_len={n} may hold: pass max_model_len >= {pages * bs}")


def load_scorer_file(path: str, layers: dict[str, KVpopLayer]) -> set[str]:
    """Copy a kvpop scorer file into the model's ``KVpopLayer`` modules (by name); the names it filled.

    ``layers`` maps a module name (``model.layers.{i}.self_attn.kvpop``) to its layer.  A file of another
    number of layers, KV heads or head size raises ``ValueError`` naming the tensor, and so do the checks
    ``kvpop.load_scorers`` makes of the tensors (floating point, finite, of a trained layer's magnitude).
    """
    from kvpop.core.checkpoint import SCORERS

    saved = SCORERS.read_tensors(path)
    want = SCORERS.fit(list(layers.values()), saved, path)  # file key -> the layer's tensor, once all fit
    pname = {f"layers.{m.layer_idx}.{k}": f"{name}.{k}" for name, m in layers.items() for k in m.state_dict()}
    with torch.no_grad():
        for key, t in want.items():
            t.copy_(saved[key].to(dtype=t.dtype, device=t.device))
    return {pname[k] for k in want}

"""DMS (dynamic memory sparsification, Łańcucki et al., 2025): the learned baseline KVpop is measured against.

DMS gives every token and KV head a binary keep-or-evict gate, learned with no target for which tokens
to keep: the gates are trained through a continuous relaxation, only by the distillation loss of the
model and an auxiliary loss that pulls the mean eviction rate to a target compression ratio.  An
evicted token is not deleted at once but when it leaves a window of the ``w`` most recent tokens
(*delayed eviction*), so every head keeps its own, growing number of tokens.  This package holds the
whole method on the model side (docs/DESIGN.md, "DMS"), one module a job: ``config``, ``gates`` (the
maths and the gate layer), ``attention`` (the attention function), ``cache``, ``patching``, ``loss``
(the training hooks), ``checkpoint`` and ``budget`` (DMS at a matched mean budget, for evaluation):

* **Gates.**  ``DMSLayer.gate``: per attention layer a linear head from the attention layer's input
  (the normalised hidden state) to one logit per KV head, ``logit[b, h, t] = W_h . x_t + b_h`` (the
  DMS code's "separate alpha" variant).  ``W = 0``, ``b = -gate_offset`` at the start, so every token is
  kept and the patched model starts exactly as the original.  A gate only acts on tokens ``t >= s``:
  the sinks are never evicted, as under every other policy of the harness.
* **Relaxation** (training, :func:`gumbel_sigmoid`): ``alpha = sigmoid((logit + n) / tau)`` with
  logistic noise ``n`` (the difference of two Gumbel samples), the probability of eviction; the hard
  decision ``alpha > 1/2`` with a straight-through gradient feeds the auxiliary loss.
* **Delayed mask** (training, :func:`dms_attention`): key ``t`` is fully visible to the queries of its
  window (``t > q - w``, as everywhere in kvpop), and beyond it its attention logit gets
  ``log(1 - alpha_t)`` (``-inf`` for a hard eviction).  A dense masked attention in PyTorch: the
  relaxed mask is an additive bias on every old key, which the sparse-attention kernel's mask
  (visible or not) cannot express.
* **Hard gates** (evaluation, teacher-forced or a cache's prefill): ``evict = logit > threshold``.  A
  token evicted at ``t`` is visible up to query ``t + w - 1``, i.e. ``evict_at[t] = t + w`` and
  ``NEVER`` for kept tokens (:func:`gate_evict_at`): exactly the sparse-attention kernel's mask, so
  it runs ``kvpop_kernels.sparse_attention``.
* **Auxiliary loss** (:func:`dms_loss`): ``mean_b relu(target_evict - evict_frac_b)`` over the hard
  (straight-through) decisions of all layers, heads and tokens ``t >= s`` of sequence ``b``, with
  ``target_evict = 1 - 1/CR(step)`` and ``CR`` rising linearly from 1 to ``1 / target_keep`` over
  ``schedule_steps`` (:func:`dms_target`).
* **Ragged cache** (:class:`DMSCache`): per layer and KV head the sinks, a ring of the window, and the
  long-range tokens it kept (``kept_len[h]`` of them) in pages of a pool the layer's heads share;
  memory is what each head keeps (plus a partial page per head and a bounded spare pool), not a
  padded maximum; a decode step reads nothing back to the host.

``patch_dms`` / ``unpatch_dms`` attach and remove it (the same model families as ``kvpop.patch``; a
model carries KVpop or DMS, not both).  ``kvpop train --method dms`` trains it (kvpop.training.train).

It is a baseline, not part of the library core: it uses the core's patch lifecycle
(``kvpop.core.lifecycle``), layer files (``kvpop.core.checkpoint``) and attention registry, and the
core never imports it.
"""
from .attention import DMS_ATTN_NAME, dms_attention_forward
from .cache import DMSCache, DMSCacheLayer, head_entries
from .checkpoint import load_dms, read_dms_config, save_dms
from .config import DMSConfig, dms_target
from .gates import DMSLayer, dms_attention, dms_layers, gate_evict_at, gumbel_sigmoid, logistic_noise
from .loss import dms_loss, set_dms_generator, set_dms_step
from .patching import get_dms_config, is_dms_patched, make_dms_teacher, patch_dms, unpatch_dms

__all__ = ["DMSConfig", "DMSLayer", "DMSCache", "DMSCacheLayer", "gumbel_sigmoid", "logistic_noise",
           "set_dms_generator",
           "dms_attention", "gate_evict_at", "dms_target", "patch_dms", "unpatch_dms", "is_dms_patched",
           "get_dms_config", "dms_layers", "dms_loss", "set_dms_step", "make_dms_teacher", "save_dms",
           "load_dms", "read_dms_config", "DMS_ATTN_NAME", "head_entries", "dms_attention_forward"]

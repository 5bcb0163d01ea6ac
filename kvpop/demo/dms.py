"""Deprecated: the DMS pieces of the harness moved: the matched-budget evaluation to
:mod:`kvpop.baselines.dms.budget`, the retrofit to :mod:`kvpop.demo.retrofit` (``retrofit_dms``).

This alias keeps ``kvpop.demo.dms.<name>`` importable for one release.
"""
import warnings

from kvpop.baselines.dms.budget import (
    GATES,
    RANGES,
    calibrate_threshold,
    dms_logits,
    dms_policy_model,
    entries_by_position,
    mean_entries,
    row_stats,
)

from .retrofit import retrofit_dms

__all__ = ["retrofit_dms", "dms_policy_model", "calibrate_threshold", "dms_logits", "row_stats", "entries_by_position",
           "mean_entries", "GATES", "RANGES"]

warnings.warn("kvpop.demo.dms is deprecated: use kvpop.baselines.dms.budget and kvpop.demo.retrofit.retrofit_dms",
              DeprecationWarning, stacklevel=2)

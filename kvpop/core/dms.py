"""Deprecated: DMS moved to :mod:`kvpop.baselines.dms` (a baseline, not part of the library core).

This alias keeps ``kvpop.core.dms.<name>`` importable for one release; import from
``kvpop.baselines.dms`` instead.
"""
import warnings

from kvpop.baselines.dms import *  # noqa: F403
from kvpop.baselines.dms import __all__  # noqa: F401

warnings.warn("kvpop.core.dms is deprecated: DMS moved to kvpop.baselines.dms", DeprecationWarning, stacklevel=2)

"""The eviction policies by name: what ``kvpop eval``, ``kvpop demo`` and the generated-answer evaluation
(:mod:`kvpop.answers`) call each row, which cache policy serves each, and which were trained how.

The policies themselves (the models and caches that serve them) are built by the harness
(``kvpop.evaluation.evaluate.policy_model``) and the commands; this module holds only their names, so that the
library, the demo and the commands read one table.
"""
from __future__ import annotations

__all__ = ["POLICIES", "DMS_POLICIES", "policy_of", "row_order", "NAME_RULE",
           "CACHE_POLICY", "SCORER_OF", "JOINT", "LABEL_SOURCES", "LABEL_VARIANTS",
           "DEFAULT_SINKS", "DEFAULT_WINDOW"]

LABEL_SOURCES = ("student", "teacher")
"""Whose attention makes a joint retrofit's label (``KVpopConfig.target_source``)."""
LABEL_VARIANTS = {f"{j}-{src}-label": j for j in ("kvpop-mlp-joint", "kvpop-mlstm-joint") for src in LABEL_SOURCES}
"""A joint retrofit trained on an explicitly named label source -> the joint policy it is a variant of
(``kvpop demo`` reports the source it did not choose under this name, beside the chosen one)."""
SCORER_OF = {"kvpop-mlp": "mlp", "kvpop-mlstm": "mlstm", "kvpop-mlp-joint": "mlp", "kvpop-mlstm-joint": "mlstm"}
SCORER_OF.update({v: SCORER_OF[j] for v, j in LABEL_VARIANTS.items()})
"""The scorer each KVpop policy of the harness trains."""
JOINT = ("kvpop-mlp-joint", "kvpop-mlstm-joint", *LABEL_VARIANTS)
"""Policies whose scorers were trained together with the model (``train_model=True``, KL to the frozen original)."""
DEFAULT_SINKS = 4
DEFAULT_WINDOW = 32

POLICIES = ("dense", "streaming", "tova", "h2o", "fixed-finetune", "kvpop-mlp", "kvpop-mlstm", "kvpop-mlp-joint",
            "kvpop-mlstm-joint", *LABEL_VARIANTS, "dms", "dms-test-calibrated")
"""Policy names, in table order.  ``dms``: DMS at the gate threshold chosen on validation sequences (fixed for
the test sequences); ``dms-test-calibrated``: the same model with the threshold calibrated on each test
sequence itself (a look at the test data no other policy gets; shown only as a labelled second row)."""
DMS_POLICIES = ("dms", "dms-test-calibrated")
CACHE_POLICY = {"streaming": "streaming", "tova": "tova", "h2o": "h2o", "fixed-finetune": "streaming",
                **{p: "kvpop" for p in SCORER_OF}}
"""The ``KVpopCache`` policy that serves each non-dense policy."""

NAME_RULE = r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}"
"""A user's name of a run (``kvpop eval --run NAME=DIR``): its row is ``POLICY[NAME]``, e.g.
``kvpop-mlp-joint[auto]`` beside ``kvpop-mlp-joint[paper]``."""


def policy_of(row: str) -> str:
    """The policy a table row serves: ``kvpop-mlp-joint[auto]`` -> ``kvpop-mlp-joint`` (a named run's row); a
    policy name is its own row."""
    return row.split("[", 1)[0] if row.endswith("]") and "[" in row else row


def row_order(row: str) -> tuple[int, str]:
    """Sort key of a table row: its policy's place in :data:`POLICIES`, then its name."""
    p = policy_of(row)
    return (POLICIES.index(p) if p in POLICIES else len(POLICIES), row)


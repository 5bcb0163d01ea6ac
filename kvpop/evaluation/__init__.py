"""The measurement engine: accuracy of eviction policies at fixed cache budgets (``evaluate``: the demo's
synthetic tasks, through the code a user runs), next-token scores on token traces (``trace_eval``: ``kvpop eval
--data``) and the token-by-token decode check (``decode_eval``).  ``kvpop eval``, ``kvpop train --auto``, the
demo and the studies measure with it."""

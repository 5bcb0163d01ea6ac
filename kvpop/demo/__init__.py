"""The demo: a synthetic long-trace task (``task``, ``lookahead_task``), dense pre-training of the shipped tiny
models (``pretrain``), the retrofits (``retrofit``) and the demo's run (``run``); it measures with
:mod:`kvpop.evaluation`."""

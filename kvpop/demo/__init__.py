"""The demo: a synthetic long-trace task (``task``), dense pre-training of the shipped tiny model
(``pretrain``), the retrofits (``retrofit``) and the evaluation of eviction policies at fixed budgets
(``evaluate``)."""

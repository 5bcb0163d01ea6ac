"""The demo: a synthetic long-trace task (``task``), dense pre-training of the shipped tiny model
(``pretrain``) and the evaluation of eviction policies at fixed budgets (``evaluate``)."""

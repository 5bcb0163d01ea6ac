"""Baselines KVpop is measured against, each in a package of its own (``dms``: DMS's learned gates).

A baseline builds on the library core (its patch lifecycle, checkpoint files and attention registry)
and the training loop's method interface; the core never imports a baseline (docs/DESIGN.md).
"""

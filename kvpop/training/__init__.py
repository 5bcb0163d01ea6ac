"""Retrofit training: the loop (``kvpop.training.train``) and JSONL data (``kvpop.training.data``).

Imports the core; never the demo or the CLI.
"""

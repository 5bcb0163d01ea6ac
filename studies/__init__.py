"""Research instruments: studies that produce the project's result documents (not part of the library API)."""

"""Contracts the gateway and the reference worker share (pure code, no I/O)."""

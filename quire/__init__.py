"""Quire's shared contract: what router and engine must agree on. Never imports torch."""

__version__ = "0.1.0"

"""Offline benchmarks of the engine (``quire bench ...``). Kept apart from the test suite: timings
are reported here, never asserted."""

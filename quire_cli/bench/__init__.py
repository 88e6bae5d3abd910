"""Benchmarks (``quire bench ...``): offline ones of the engine (throughput, latency,
prefix-cache, step profile) and online ones of the router in front of real engine processes
(serve, router-overhead). Kept apart from the test suite: timings are reported here, never
asserted. Each module is imported only when its benchmark runs (see ``quire_cli.main``)."""

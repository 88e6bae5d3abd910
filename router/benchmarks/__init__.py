"""Online benchmarks of the router in front of real engine processes (``quire bench serve``,
``quire bench router-overhead``). Torch stays out of this process: engines are subprocesses."""

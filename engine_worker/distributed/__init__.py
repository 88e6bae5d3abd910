"""One model across several processes: tensor parallelism over torch.distributed.

``shard``: which slice of every layer a rank holds, and how a full checkpoint is sliced to it;
``comm``: the collectives a shard needs (all-reduce, logits gather, the step broadcast);
``executor``: rank 0's side (starts the workers, sends each step, watches them);
``worker``: a worker process's side.
"""

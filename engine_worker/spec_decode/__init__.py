"""Speculative decoding: proposals of a few tokens per request, verified in one target forward.

``config`` parses vLLM's ``speculative_config``; ``ngram`` (and the other methods) propose
draft tokens from what a request already holds; ``speculator`` decides per request and per
step how many drafts run (adaptivity, the batch rule) and keeps the acceptance counts;
``rejection_sampler`` turns the target's per-position samples into the accepted tokens.
"""

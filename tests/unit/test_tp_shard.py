"""Which slice of a Llama model each tensor-parallel rank holds (engine_worker.distributed.shard)."""

from __future__ import annotations

import pytest
import torch

from engine_worker.distributed.shard import TPShard, check_divisible, shard_llama_state, \
    shard_vocab_rows


def _shard(rank, size, heads=8, kv=2, inter=16, vocab=10):
    return TPShard.of(rank, size, num_heads=heads, num_kv_heads=kv, intermediate_size=inter,
                      vocab_size=vocab)


def test_kv_heads_split_where_they_divide_and_replicate_where_tp_exceeds_them():
    assert [(s.num_kv_heads, s.kv_head_start) for s in (_shard(r, 2) for r in range(2))] == \
        [(1, 0), (1, 1)]
    # tp 8 over 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1 (vLLM's rule)
    assert [_shard(r, 8).kv_head_start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(_shard(r, 8).num_kv_heads == 1 and _shard(r, 8).num_heads == 1
               for r in range(8))


@pytest.mark.parametrize("size, heads, kv, inter, message", [
    (3, 9, 3, 12, None),
    (2, 9, 3, 12, "tensor_parallel_size: 2 does not divide the model's 9 attention heads"),
    (4, 12, 6, 16, "tensor_parallel_size: 4 neither divides the model's 6 KV heads nor is a "
                   "multiple of them"),
    (4, 8, 4, 18, "tensor_parallel_size: 4 does not divide the model's MLP width 18"),
])
def test_sizes_that_do_not_split_the_model_name_both_numbers(size, heads, kv, inter, message):
    if message is None:
        check_divisible(size, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)
        return
    with pytest.raises(ValueError, match=message):
        check_divisible(size, num_heads=heads, num_kv_heads=kv, intermediate_size=inter)


def test_slices_concatenate_back_to_the_checkpoint():
    heads, kv, head_dim, hidden, inter, vocab = 4, 2, 2, 8, 6, 7
    g = torch.Generator().manual_seed(0)
    state = {
        "layers.0.self_attn.qkv_proj.weight": torch.randn((heads + 2 * kv) * head_dim, hidden,
                                                          generator=g),
        "layers.0.self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim, generator=g),
        "layers.0.self_attn.o_proj.bias": torch.randn(hidden, generator=g),
        "layers.0.mlp.gate_up_proj.weight": torch.randn(2 * inter, hidden, generator=g),
        "layers.0.mlp.down_proj.weight": torch.randn(hidden, inter, generator=g),
        "embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "norm.weight": torch.randn(hidden, generator=g),
    }
    shards = [TPShard.of(r, 2, num_heads=heads, num_kv_heads=kv, intermediate_size=inter,
                         vocab_size=vocab) for r in range(2)]
    parts = [shard_llama_state(state, shard=s, num_heads=heads, num_kv_heads=kv,
                               head_dim=head_dim) for s in shards]
    q, k, v = state["layers.0.self_attn.qkv_proj.weight"].split([8, 4, 4])
    for r, part in enumerate(parts):  # q rows of heads 2r, 2r+1; k and v of KV head r
        assert torch.equal(part["layers.0.self_attn.qkv_proj.weight"],
                           torch.cat([q[4 * r:4 * r + 4], k[2 * r:2 * r + 2],
                                      v[2 * r:2 * r + 2]]))
    o = torch.cat([p["layers.0.self_attn.o_proj.weight"] for p in parts], dim=1)
    assert torch.equal(o, state["layers.0.self_attn.o_proj.weight"])
    # a row-parallel bias is added once: rank 0 holds it, the others zeros
    assert torch.equal(parts[0]["layers.0.self_attn.o_proj.bias"] +
                       parts[1]["layers.0.self_attn.o_proj.bias"],
                       state["layers.0.self_attn.o_proj.bias"])
    gate, up = state["layers.0.mlp.gate_up_proj.weight"].chunk(2)
    assert torch.equal(parts[1]["layers.0.mlp.gate_up_proj.weight"],
                       torch.cat([gate[3:], up[3:]]))
    # vocabulary rows: 7 over 2 ranks is 4 each, the last padded with a zero row
    embed = torch.cat([p["embed_tokens.weight"] for p in parts])
    assert embed.shape[0] == 8 and torch.equal(embed[:7], state["embed_tokens.weight"])
    assert not embed[7].any()
    assert all(torch.equal(p["norm.weight"], state["norm.weight"]) for p in parts)


def test_gguf_blocks_split_by_whole_blocks_and_a_width_they_do_not_divide_is_named():
    # Q8_0 blocks as the file has them: uint8 [rows, K / 32, 34]; o's 3 blocks a row do not
    # split in two, down's 4 do (2 a rank, exactly the file's bytes)
    def blocks(rows: int, nb: int) -> torch.Tensor:
        return torch.arange(rows * nb * 34).remainder(251).to(torch.uint8).reshape(rows, nb, 34)

    shard = _shard(1, 2, heads=4, kv=2, inter=8)
    down = blocks(6, 4)
    part = shard_llama_state({"layers.0.mlp.down_proj.weight": down}, shard=shard,
                             num_heads=4, num_kv_heads=2, head_dim=24)
    assert torch.equal(part["layers.0.mlp.down_proj.weight"], down[:, 2:])
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide the 3 "
                                         "quantized blocks of a row of layers.0.self_attn"):
        shard_llama_state({"layers.0.self_attn.o_proj.weight": blocks(6, 3)}, shard=shard,
                          num_heads=4, num_kv_heads=2, head_dim=24)
    # the vocabulary's rows of blocks: the last rank's padded with zero blocks
    shard = _shard(1, 2, heads=4, kv=2, inter=8, vocab=3)
    tied = blocks(3, 2)
    rows = shard_vocab_rows(tied, shard)
    assert rows.shape == (2, 2, 34) and torch.equal(rows[0], tied[2]) and not rows[1].any()


def test_pipeline_micro_batches_split_large_steps_only():
    from engine_worker.distributed.shard import PPStage

    stage = PPStage.of(0, 2, 12)  # pieces of at least 64 tokens, up to two a stage
    assert stage.micro_batches(256) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert stage.micro_batches(1000) == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert stage.micro_batches(150) == [(0, 75), (75, 150)]
    assert stage.micro_batches(127) == [(0, 127)]  # a decode batch: weights streamed once
    assert PPStage.of(0, 2, 12, micro_batch_tokens=0).micro_batches(1000) == [(0, 1000)]
    assert PPStage.whole(12).micro_batches(1000) == [(0, 1000)]


def test_a_negative_micro_batch_size_is_refused_naming_it():
    from engine_worker.config import ParallelConfig

    with pytest.raises(ValueError, match="pipeline_micro_batch_tokens"):
        ParallelConfig(pipeline_micro_batch_tokens=-1)

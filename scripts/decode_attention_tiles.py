"""Decode attention alone, AMX tiles against AVX-512 BF16 vectors, taking turns in one process.

    python scripts/decode_attention_tiles.py [--keys 320] [--layout scattered|hot] [--repeats 8]

64 decodes of SmolLM2's shape (9 query / 3 kv heads of 64, bf16 cache, blocks of 16) over 30
layers' caches, the op `attention_tiles` switching between the two kernels. `hot`: every
sequence reads the same few blocks (the K/V stay in cache: the kernels' own cost);
`scattered`: blocks drawn at random from a 2 GB cache (what a serving step reads). Prints the
median milliseconds of each, and the largest difference of their outputs. Needs the AVX-512
set on a CPU with AMX for the tiles to run (elsewhere both turns run the vectors)."""
import argparse
import statistics
import time

import torch

from engine_worker.ops import VARIANTS, load
from engine_worker.platform import allocate_zeroed

ap = argparse.ArgumentParser()
ap.add_argument("--keys", type=int, default=320)
ap.add_argument("--layout", choices=["scattered", "hot"], default="scattered")
ap.add_argument("--repeats", type=int, default=8)
args = ap.parse_args()
torch.set_num_threads(2)
ops = load(VARIANTS["avx512"]).ops
batch, block, heads, kv_heads, d, layers = 64, 16, 9, 3, 64, 30
blocks_per_seq = -(-args.keys // block)
num_blocks = 64 if args.layout == "hot" else 128000 // block
g = torch.Generator().manual_seed(0)
caches = []
for _ in range(layers):
    c = allocate_zeroed((2, num_blocks, block, kv_heads, d), torch.bfloat16, torch.device("cpu"))
    c.copy_(torch.randn(2, num_blocks, block, kv_heads, d, generator=g).to(torch.bfloat16))
    caches.append(c)
if args.layout == "hot":
    tables = torch.arange(blocks_per_seq, dtype=torch.int32).repeat(batch, 1)
else:
    tables = torch.randperm(num_blocks, generator=g)[:batch * blocks_per_seq]
    tables = tables.to(torch.int32).view(batch, blocks_per_seq)
q = torch.randn(batch, heads, d, generator=g).to(torch.bfloat16)
qsl = torch.arange(batch + 1, dtype=torch.int64)
lens = torch.full((batch,), args.keys, dtype=torch.int64)
outs = {}
for tiles in (True, False):
    print("tiles" if tiles else "vectors", "run:", ops.attention_tiles(tiles))
    outs[tiles] = torch.empty_like(q)
    ops.paged_attention(outs[tiles], q, caches[0], tables, qsl, lens, d ** -0.5)
print("largest difference, tiles - vectors:",
      (outs[True].float() - outs[False].float()).abs().max().item())
ms = {True: [], False: []}
out = torch.empty_like(q)
for _ in range(args.repeats):
    for tiles in (True, False):
        ops.attention_tiles(tiles)
        start = time.perf_counter()
        for c in caches:
            ops.paged_attention(out, q, c, tables, qsl, lens, d ** -0.5)
        ms[tiles].append((time.perf_counter() - start) * 1000)
ops.attention_tiles(True)
for tiles in (True, False):
    print(f"{'tiles' if tiles else 'vectors'}: median {statistics.median(ms[tiles]):.1f} ms for "
          f"{layers} layers ({args.layout}, {args.keys} keys)", [round(x, 1) for x in ms[tiles]])

"""The int8 GGUF linear kernel (csrc/cpu/quant_linear.cpp) against the bf16 matmul of the same
weights de-quantized and packed (what a bf16 twin, or the ``dequantize`` path, multiplies),
over rows of x.

A microbenchmark, not a test: SmolLM2-135M's four linears of one layer (q/k/v fused, o,
gate/up fused, down) as random Q4_1 weights, and its tied Q8_0 logits table (49152 x 576),
best of ``--repeats`` calls each. The AVX-512 set (``--variant avx512``): bf16 x against
oneDNN's bf16 matmul on its packed layout. The AVX2 set (``--variant avx2``): fp32 x, as its
stack carries a bf16 model's activations (the kernel told the model's dtype), against
``linear_bf16w`` on bf16 panels. Prints a table and writes JSON:

    .venv/bin/python scripts/quant_linear_bench.py --rows 1,8,64,256,1024,4096 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of each linear
LOGITS = [(49152, 576)]


def weights(ops, shapes, qtype, rng, panels: bool):
    from gguf.quants import dequantize, quantize

    out = []
    for n, k in shapes:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        raw = quantize(w, qtype)
        blocks = ops.repack_gguf(torch.from_numpy(raw.reshape(n, k // 32, -1).copy()))
        dense = torch.from_numpy(dequantize(raw, qtype)).to(torch.bfloat16)
        packed = ops.pack_bf16w(dense) if panels else \
            torch.ops.mkldnn._reorder_linear_weight(dense, None)
        out.append((blocks, packed, n, k))
    return out


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,64,256,1024,4096")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variant", default="avx512", help="the CPU kernel set to load")
    parser.add_argument("--out", type=Path, default=None, help="JSON to write")
    ns = parser.parse_args()
    from gguf import GGMLQuantizationType as QT

    from engine_worker.ops import Unavailable, load

    kernels = load(ns.variant)
    if isinstance(kernels, Unavailable):
        print(f"{ns.variant}: {kernels.reason}")
        return 1
    torch.set_num_threads(ns.threads)
    rng = np.random.default_rng(0)
    panels = kernels.isa == "avx2"
    x_dtype = torch.float32 if panels else torch.bfloat16
    cases = {"layer Q4_1": weights(kernels.ops, LAYER, QT.Q4_1, rng, panels),
             "logits Q8_0": weights(kernels.ops, LOGITS, QT.Q8_0, rng, panels)}
    rows = [int(r) for r in ns.rows.split(",")]
    result = {"cpu": platform.processor() or platform.machine(), "threads": ns.threads,
              "variant": ns.variant, "x_dtype": str(x_dtype).removeprefix("torch."),
              "baseline": "linear_bf16w on bf16 panels" if panels else
              "oneDNN bf16 matmul, packed", "loadavg_1m_at_start": os.getloadavg()[0],
              "cases": {}}
    print(f"{'case':12} {'rows':>5} {'int8 ms':>9} {'GMAC/s':>7} {'bf16 ms':>9} {'GMAC/s':>7} "
          f"{'bf16/int8':>9}")
    for name, ws in cases.items():
        result["cases"][name] = []
        for m in rows:
            xs = {k: torch.randn(m, k).to(x_dtype) for k in {k for *_, k in ws}}

            def int8():
                for blocks, _, _, k in ws:  # a bf16 model's rows, whatever x's dtype
                    kernels.ops.quant_linear(xs[k], blocks, None, torch.bfloat16)

            def bf16():
                for _, packed, _, k in ws:
                    if panels:
                        kernels.ops.linear_bf16w(xs[k], packed, None)
                    else:
                        torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")

            t_int8, t_bf16 = best_seconds(int8, ns.repeats), best_seconds(bf16, ns.repeats)
            macs = m * sum(n * k for _, _, n, k in ws)
            row = {"rows": m, "int8_ms": t_int8 * 1e3, "bf16_ms": t_bf16 * 1e3,
                   "int8_gmacs": macs / t_int8 / 1e9, "bf16_gmacs": macs / t_bf16 / 1e9,
                   "bf16_over_int8": t_bf16 / t_int8}
            result["cases"][name].append(row)
            print(f"{name:12} {m:5d} {row['int8_ms']:9.3f} {row['int8_gmacs']:7.1f} "
                  f"{row['bf16_ms']:9.3f} {row['bf16_gmacs']:7.1f} {row['bf16_over_int8']:9.2f}")
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

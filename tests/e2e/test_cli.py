"""The `quire` command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_worker import LLM, SamplingParams


def _quire(*args: str, stdin: str | None = None, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "quire_cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow  # starts engine processes
def test_generate_streams_the_same_text_as_the_api(tiny_model_dir):
    result = _quire("generate", "The weather today", "--no-chat-template", "--model",
                    str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "12",
                    "--kv-cache-memory-bytes", str(1 << 22))
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
    expected = llm.generate("The weather today", SamplingParams(temperature=0, max_tokens=12),
                            use_tqdm=False)[0].outputs[0].text
    assert result.stdout == expected + "\n"


@pytest.mark.slow  # starts engine processes
def test_engine_flags_come_from_environment_and_bad_values_exit_2(tiny_model_dir):
    result = _quire("generate", "hi", "--model", str(tiny_model_dir), "--max-tokens", "2",
                    env={"QUIRE_MAX_NUM_SEQS": "0"})
    assert result.returncode == 2
    assert "max_num_seqs: must be a positive integer" in result.stderr
    result = _quire("generate", "hi", "--model", str(tiny_model_dir), "--max-tokens", "2",
                    "--max-num-seqs", "4", env={"QUIRE_MAX_NUM_SEQS": "0"})
    assert result.returncode == 0, result.stderr  # the flag beats the environment


@pytest.mark.slow  # starts engine processes
def test_chat_keeps_history_and_ends_on_empty_line(tiny_model_dir):
    result = _quire("chat", "--model", str(tiny_model_dir), "--max-tokens", "4",
                    "--system", "Be brief.", stdin="hello\nand again\n\n")
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(replies) == 2


@pytest.mark.slow  # loads the embedded SmolLM2 model
def test_gguf_path_and_hub_id_load_the_embedded_model(embedded_model_dir):
    from engine_worker.weights.resolve import embedded_gguf_path, resolve_model_dir

    # a GGUF named by path is converted once; the same file resolves to the same directory
    assert resolve_model_dir(str(embedded_gguf_path())) == embedded_model_dir
    assert resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == embedded_model_dir
    llm = LLM(str(embedded_gguf_path()), kv_cache_memory_bytes=1 << 24)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0]
    assert out.outputs[0].text.strip().startswith("Paris")


def test_help_imports_only_the_chosen_subcommand():
    """`quire --help` loads no application; `quire router --help` only the router (the router
    image has no torch, and nothing of the engine is needed to route)."""
    for argv, allowed in ((["--help"], set()), (["router", "--help"], {"router"}),
                          (["bench", "--help"], set())):
        code = ("import sys\nfrom quire_cli.main import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0\n"
                "import json\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
        heavy = {"torch", "transformers", "engine_worker", "router"} - allowed
        assert "quire_cli" in loaded and not loaded & heavy, (argv, loaded & heavy)

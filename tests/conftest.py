"""Shared fixtures: tiny random Llama-family checkpoints built in the test, and the embedded model.

Tiny models borrow the embedded SmolLM2 tokenizer (converted once into the Quire cache), so text
round-trips are real; their weights are random and written with transformers' own save_pretrained.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run in Triton's CPU interpreter; it must be chosen before any
# kernel module is imported (``@triton.jit`` decides at decoration time).
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis profiles, chosen by QUIRE_FUZZ. Unset ("deterministic"): every property test draws
# the same examples on every run and machine (derandomized from the test's own code, no example
# database), so CI never fails at random. QUIRE_FUZZ=explore: new random examples on every run,
# many more of them in the fuzz suite, failures kept in .hypothesis/ and replayed first next
# time; what it finds goes into the test as an explicit @example. Neither has a deadline or the
# too-slow health check: a test's outcome must not depend on how busy the machine is.
FUZZ_ENV = "QUIRE_FUZZ"


def _profiles():
    from hypothesis import HealthCheck

    no_timing = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    return {"deterministic": dict(derandomize=True, database=None, **no_timing),
            "explore": dict(derandomize=False, max_examples=2000, **no_timing)}


def pytest_configure(config):
    from hypothesis import settings

    # before any test module is imported: module-level settings() inherit the loaded profile
    profiles = _profiles()
    for name, values in profiles.items():
        settings.register_profile(name, **values)
    profile = os.environ.get(FUZZ_ENV) or "deterministic"
    if profile not in profiles:
        raise pytest.UsageError(f"{FUZZ_ENV}={profile!r}: choose from {sorted(profiles)}")
    settings.load_profile(profile)


# CI (.ci/run) starts the vLLM tests beside the suite once it reaches tests/unit, whose tests
# mostly run one thread and leave the other core idle: the suite marks the moment by creating
# the file this variable names (unset: nothing happens).
CI_UNIT_PHASE_ENV = "QUIRE_CI_UNIT_PHASE_FILE"


def pytest_runtest_logstart(nodeid, location):
    mark = os.environ.get(CI_UNIT_PHASE_ENV)
    if mark and nodeid.startswith("tests/unit/") and not os.path.exists(mark):
        Path(mark).touch()


@pytest.fixture(autouse=True)
def _same_global_random_state():
    """Every test starts from the same global random state, whatever ran before it and however
    the tests were selected: a draw from Python's or torch's global generator is seeded."""
    random.seed(0)
    torch = sys.modules.get("torch")  # never imported here for tests that do not use it
    if torch is not None:
        torch.manual_seed(0)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(0)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


def float_checkpoint(hf_dir: Path, out_dir: Path, tensors: dict) -> Path:
    """A float checkpoint directory of ``tensors`` (the names a GGUF writer returns, without
    the ``model.`` prefix) with ``hf_dir``'s config and tokenizer: the de-quantized reference
    a native GGUF engine is compared against."""
    from safetensors.torch import save_file

    out_dir.mkdir()
    save_file({f"model.{k}": v.contiguous() for k, v in tensors.items()},
              str(out_dir / "model.safetensors"))
    for name in ("config.json", *TOKENIZER_FILES):
        if (hf_dir / name).exists():
            shutil.copy(hf_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from engine_worker.weights.resolve import resolve_model_dir

    return resolve_model_dir(None)


def build_tiny_model(out_dir: Path, tokenizer_dir: Path, *, arch: str = "llama",
                     tie_word_embeddings: bool = True, rope: dict | None = None,
                     num_layers: int = 3, num_heads: int = 4, num_kv_heads: int = 2,
                     hidden_size: int = 64, max_position_embeddings: int = 1024,
                     attention_bias: bool = False, seed: int = 0) -> Path:
    """Save a random transformers model (vocab of the embedded tokenizer) into ``out_dir``."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    kwargs = dict(vocab_size=49152, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  tie_word_embeddings=tie_word_embeddings, rms_norm_eps=1e-5,
                  # larger weights than the default 0.02 give peaked distributions, so greedy
                  # comparisons test the model and not float noise between near-equal logits
                  initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if rope is not None:
        kwargs["rope_parameters"] = rope
    if attention_bias:
        kwargs["attention_bias"] = True
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # transformers zeroes biases at init: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_model_dir) -> Path:
    """Llama with GQA (4 query heads on 2 KV heads), 3 layers, tied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), embedded_model_dir)


# ---------------------------------------------------------------- CPU kernel variants under test

# For tests only, never chosen by the engine: the AVX-512 set's code compiled for an AVX2 CPU
# with SIMDe's portable AVX-512 intrinsics, so a machine without AVX-512 checks that set's
# numerics too (oneDNN's bf16 matmul, which checks the CPU itself, is not emulated).
EMULATED_AVX512_PRELUDE = (Path(__file__).resolve().parents[1] / "csrc" / "cpu" / "emulated"
                           / "avx512_on_avx2.h")
CPU_VARIANT_NAMES = ("avx512", "avx512_emulated", "avx2")
# the backend over each instruction set's kernels (what kernels= names)
CPU_BACKEND_OF_ISA = {"avx512": "cpu", "avx2": "cpu-avx2"}


def cpu_kernels_unavailable_reason(name: str) -> str | None:
    """Why the engine's kernel variant ``name`` cannot run here, or None where it loads."""
    from engine_worker.ops import Unavailable, load

    loaded = load(name)
    return loaded.reason if isinstance(loaded, Unavailable) else None


def _emulated_avx512():
    import simde_py

    from engine_worker.ops import VARIANTS, CpuVariant

    return CpuVariant("avx512_emulated", "avx512", VARIANTS["avx2"].isa_flags, host_isa="avx2",
                      extra_cflags=(f"-I{simde_py.get_include()}", "-include",
                                    str(EMULATED_AVX512_PRELUDE)),
                      extra_headers=(EMULATED_AVX512_PRELUDE,))


def use_cpu_variant(monkeypatch, name: str):
    """The kernels of the variant ``name`` (one of ``CPU_VARIANT_NAMES``; an
    ``engine_worker.ops.CpuKernels``); for the rest of the test, the backend of that variant's
    instruction set (``CPU_BACKEND_OF_ISA``), and so an engine built with that ``kernels=``,
    runs them (the registry entry is swapped). Skips with the reason where they cannot run."""
    import pytest

    from engine_worker.backends import BACKENDS
    from engine_worker.backends.cpu import cpu_backend_entry
    from engine_worker.ops import VARIANTS, Unavailable, load

    if name == "avx512_emulated":
        if cpu_kernels_unavailable_reason("avx512") is None:
            pytest.skip("the real avx512 kernels run on this CPU")
        pytest.importorskip("simde_py", reason="the emulated kernels need SIMDe's headers "
                            "(simde-py, part of the dev extra)")
        variant = _emulated_avx512()
    else:
        variant = VARIANTS[name]
    kernels = load(variant)
    if isinstance(kernels, Unavailable):
        pytest.skip(f"CPU kernels: {kernels.reason}")
    backend_name = CPU_BACKEND_OF_ISA[variant.isa]
    entry = BACKENDS[backend_name]
    description = entry.description + ("" if variant.name == variant.isa
                                       else f" ({variant.name})")
    monkeypatch.setitem(BACKENDS, backend_name,
                        cpu_backend_entry(backend_name, description, variant))
    return kernels

"""The grammar bitmask and logit_bias in the sampler, and the shared checks of their specs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.grammar import GrammarBitmask
from engine_worker.grammar_worker import choice_grammar
from engine_worker.sampler import apply_token_bitmask
from engine_worker.sampling_params import SamplingParams, StructuredOutputsParams
from quire.errors import FieldError
from quire.structured_outputs import check_logit_bias, structured_outputs_kind
from tests.unit.test_sampler import DEVICE_ROUNDS, _meta, sample

VOCAB = 300  # not a multiple of 32: the last word is partly past the vocabulary


def _bitmask(allowed: np.ndarray) -> torch.Tensor:
    """int32 words [rows, ceil(vocab / 32)] from a bool [rows, vocab] array."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), dtype=bool)
    padded[:, :vocab] = allowed
    bits = padded.reshape(rows, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return torch.from_numpy(bits.sum(axis=-1).astype(np.uint32).view(np.int32))


def test_bitmask_unpacks_bit_by_bit():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, VOCAB)) < 0.3
    allowed[:, 31] = allowed[:, 32] = True  # the sign bit of word 0, bit 0 of word 1
    logits = torch.randn(3, VOCAB)
    masked = apply_token_bitmask(logits, _bitmask(allowed))
    assert torch.equal(torch.isfinite(masked), torch.from_numpy(allowed))
    assert torch.equal(masked[torch.from_numpy(allowed)], logits[torch.from_numpy(allowed)])


@pytest.mark.parametrize("case", ["plain", "top_k", "top_p", "min_p", "device_rounds"])
def test_masked_sampler_never_picks_a_masked_token(case):
    """Masks that leave few, unlikely tokens (the likeliest always masked) at temperature 1
    and above: over many draws every token drawn is allowed."""
    rng = np.random.default_rng(1)
    rows, draws = 8, 200
    allowed = np.zeros((rows, VOCAB), dtype=bool)
    for r in range(rows):
        allowed[r, rng.choice(VOCAB, size=r + 1, replace=False)] = True
    logits = torch.randn(rows, VOCAB) * 3
    top = logits.argmax(dim=-1)
    allowed[np.arange(rows), top.numpy()] = False
    allowed[np.arange(rows), (top.numpy() + 1) % VOCAB] = True  # at least one left
    extra = {"plain": {}, "top_k": {"top_k": torch.full((rows,), 5)},
             "top_p": {"top_p": torch.full((rows,), 0.5)},
             "min_p": {"min_p": torch.full((rows,), 0.2)},
             "device_rounds": {"top_p": torch.full((rows,), 0.7), "rounds": DEVICE_ROUNDS}}[case]
    meta = _meta(rows, temperature=torch.full((rows,), 1.5), token_bitmask=_bitmask(allowed),
                 **extra)
    generator = torch.Generator().manual_seed(3)
    seen = np.zeros_like(allowed)
    for _ in range(draws):
        tokens, _ = sample(logits, meta, generator)
        seen[np.arange(rows), tokens.numpy()] = True
    assert not (seen & ~allowed).any()
    assert seen.sum() > rows  # the draws were random, not one token a row


def test_greedy_rows_take_the_best_allowed_token():
    logits = torch.randn(2, VOCAB)
    allowed = np.ones((2, VOCAB), dtype=bool)
    allowed[0, logits[0].argmax()] = False
    meta = _meta(2, temperature=torch.zeros(2), all_greedy=True, any_greedy=True,
                 token_bitmask=_bitmask(allowed))
    tokens, _ = sample(logits, meta, None)
    assert tokens[0] == logits[0].topk(2).indices[1] and tokens[1] == logits[1].argmax()


def test_logit_bias_moves_and_bans_tokens():
    logits = torch.randn(2, VOCAB)
    best = int(logits[0].argmax())
    meta = _meta(2, temperature=torch.zeros(2), all_greedy=True, any_greedy=True,
                 logit_bias=((0, best, -100.0), (1, 7, 100.0)))
    tokens, _ = sample(logits, meta, None)
    assert tokens[0] == logits[0].topk(2).indices[1] and tokens[1] == 7


def test_bitmask_rows_follow_request_ids():
    words = np.arange(6, dtype=np.int32).reshape(2, 3)
    mask = GrammarBitmask(("a", "b"), words)
    rows = mask.rows_for(["x", "b", "a", "a"])  # a fork takes its parent's row
    assert rows.tolist() == [[-1, -1, -1], [3, 4, 5], [0, 1, 2], [0, 1, 2]]
    assert mask.rows_for(["x"]) is None


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


@pytest.mark.parametrize("spec, field", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", ""]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
    ({"jsonschema": {}}, "structured_outputs.jsonschema"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
    ({"regex": "a", "disable_additional_properties": 1},
     "structured_outputs.disable_additional_properties"),
    ({"regex": "a", "whitespace_pattern": 3}, "structured_outputs.whitespace_pattern"),
    ({"regex": "a", "disable_fallback": "no"}, "structured_outputs.disable_fallback"),
    ({"disable_any_whitespace": True}, "structured_outputs"),  # an option is not a kind
])
def test_malformed_specs_name_their_field(spec, field):
    with pytest.raises(FieldError) as e:
        structured_outputs_kind(spec)
    assert e.value.field == field
    with pytest.raises(FieldError) as e:
        SamplingParams(structured_outputs=spec)
    assert e.value.field == field


def test_vllm_options_are_accepted_beside_the_kind_and_do_not_change_the_grammar():
    """vLLM's StructuredOutputsParams options (disable_any_whitespace, ...) are taken as it
    takes them; the compiled grammar is the kind's alone (compact, strict JSON either way)."""
    plain = StructuredOutputsParams(json={"type": "object"})
    for options in ({"disable_any_whitespace": True}, {"disable_any_whitespace": False},
                    {"disable_additional_properties": True}, {"whitespace_pattern": r"[ ]?"},
                    {"disable_fallback": True}):
        spec = {"json": {"type": "object"}, **options}
        assert structured_outputs_kind(spec) == ("json", {"type": "object"})
        assert StructuredOutputsParams(**spec).spec() == plain.spec()
        assert SamplingParams(structured_outputs=spec).structured_outputs.spec() == plain.spec()


def test_spec_keys_keep_property_order():
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {}, "b": {}}}')
    assert a.spec() != b.spec() and a.spec()[0] == "json"
    assert StructuredOutputsParams(json='{"type": "object"}').spec() == \
        StructuredOutputsParams(json={"type": "object"}).spec()


@pytest.mark.parametrize("bias, vocab", [
    ({"1": 101}, None), ({1: -100.5}, None), ({"x": 1}, None), ({-1: 1}, None),
    ({"1": float("nan")}, None), ({"1": True}, None), ({5: 1}, 5), ([1], None),
])
def test_bad_logit_bias_is_refused(bias, vocab):
    with pytest.raises(FieldError) as e:
        check_logit_bias(bias, vocab)
    assert e.value.field == "logit_bias"


def test_logit_bias_accepts_json_keys():
    assert check_logit_bias({"3": 100, 4: -100, "5": 0.5}, 6) == {3: 100.0, 4: -100.0, 5: 0.5}


def test_vllm_engines_get_the_fields_under_vllms_names():
    from quire.v1 import engine_pb2 as pb
    from router.vllm_client import completion_body

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingOptions(
        logit_bias={7: -100.0}, structured_outputs=pb.StructuredOutputs(
            json='{"type": "object"}')))
    body = completion_body("m", request)
    assert body["logit_bias"] == {"7": -100.0}
    assert body["structured_outputs"] == {"json": {"type": "object"}}
    request.sampling.structured_outputs.choice.choices[:] = ["a", "b"]
    assert completion_body("m", request)["structured_outputs"] == {"choice": ["a", "b"]}
    # no max_tokens: null (vLLM's "what the context leaves"), not vLLM's completions default
    # of 16
    assert completion_body("m", request)["max_tokens"] is None
    request.sampling.max_tokens = 5
    assert completion_body("m", request)["max_tokens"] == 5


@pytest.mark.parametrize("kind, spec, refused", [
    ("grammar", "root ::= root", True),
    ("grammar", "root ::= a\na ::= root", True),
    ("grammar", 'root ::= root "x" | "y"', False),
    ("grammar", 'root ::= "x"*', False),  # the end at once is text too (empty)
    ("regex", "a|b", False),
    ("regex", "z", True),  # no token of this vocabulary spells it
    ("json", '{"anyOf": []}', True),  # only the end may come first: no JSON value (probe 5)
])
def test_a_spec_no_token_can_begin_is_refused_naming_its_field(kind, spec, refused):
    """A spec that allows no first token, not even the end (found by a probe: ``root ::=
    root`` answered every request with nothing), is a 400 naming its field."""
    import xgrammar as xgr

    from engine_worker.grammar_worker import compile_spec

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b", "x", "y", "</s>"],
                                                     stop_token_ids=[4]))
    if not refused:
        compile_spec(compiler, kind, spec)
        return
    with pytest.raises(FieldError) as e:
        compile_spec(compiler, kind, spec)
    assert e.value.field == f"structured_outputs.{kind}"
    assert ("allows no JSON value" if kind == "json" else "matches no text") in str(e.value)


@pytest.mark.slow  # the embedded model's tokenizer, and xgrammar's first import (twice)
def test_compiled_grammars_are_cached_and_compiled_in_a_worker_process(embedded_model_dir):
    """compile_async compiles in a child process and reads the result back: the grammar
    allows exactly what the same spec compiled here allows, it is cached (a second request,
    offline or served, compiles nothing), and a spec xgrammar refuses names its field."""
    import asyncio
    import os

    import xgrammar as xgr

    from engine_worker.grammar import GrammarCompilerCache, RequestGrammar
    from engine_worker.tokenizer import Tokenizer

    tokenizer = Tokenizer(embedded_model_dir)
    cache = GrammarCompilerCache(lambda: tokenizer.hf, 49152, tokenizer.eos_token_ids)
    here = GrammarCompilerCache(lambda: tokenizer.hf, 49152, tokenizer.eos_token_ids)
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]})

    async def served():
        first = await cache.compile_async(params)
        pids = cache.worker_pids()
        second = await cache.compile_async(params)
        with pytest.raises(FieldError) as e:
            await cache.compile_async(StructuredOutputsParams(regex="[z-a]"))
        await cache.aclose()
        return first, pids, second, e.value

    first, pids, second, refused = asyncio.run(served())
    assert refused.field == "structured_outputs.regex" and "cannot be compiled" in str(refused)
    assert pids and os.getpid() not in pids and second is first
    assert cache.compile(StructuredOutputsParams(
        json='{"type":"object","properties":{"a":{"type":"integer"},"b":{"enum":["x","y"]}},'
             '"required":["a","b"]}')) is first  # the same spec, canonically: no new compile
    local = here.compile(params)
    # the same tokens allowed after each prefix of one valid output
    text = '{"a": 12, "b": "y"}'  # xgrammar's separators without any_whitespace: ", " ": "
    ids = tokenizer.encode(text, add_special_tokens=False)
    ours, theirs = RequestGrammar(first), RequestGrammar(local)
    for token_id in [None, *ids]:
        if token_id is not None:
            assert ours.accept(token_id) and theirs.accept(token_id)
        masks = xgr.allocate_token_bitmask(2, 49152)
        ours.fill(masks, 0)
        theirs.fill(masks, 1)
        assert (masks[0] == masks[1]).all()
    eos = min(tokenizer.eos_token_ids)
    assert ours.accept(eos) and theirs.accept(eos) and ours.is_terminated and theirs.is_terminated
    here.close()


@pytest.mark.slow  # the embedded model's tokenizer, and a worker process's start
def test_a_request_for_a_spec_whose_compile_is_being_stopped_gets_a_fresh_compile(
        embedded_model_dir):
    """The last waiter of a costly compile leaves (its compile is cancelled and its worker
    killed); a request for the same spec arriving before that compile has ended waits for a
    compile of its own, instead of inheriting the cancellation."""
    import asyncio

    from engine_worker.grammar import GrammarCompilerCache
    from engine_worker.tokenizer import Tokenizer

    tokenizer = Tokenizer(embedded_model_dir)
    cache = GrammarCompilerCache(lambda: tokenizer.hf, 49152, tokenizer.eos_token_ids,
                                 compile_timeout_s=600)
    costly = StructuredOutputsParams(
        json='{"type": "string", "pattern": "([a-w]{1,40}){1,40}"}')

    async def main():
        first = asyncio.ensure_future(cache.compile_async(costly))
        for _ in range(400):  # until its worker runs it
            await asyncio.sleep(0.05)
            if cache.worker_pids():
                break
        killed = cache.worker_pids()
        first.cancel()
        await asyncio.sleep(0)  # its waiter has left: the compile is being stopped
        second = asyncio.ensure_future(cache.compile_async(costly))
        for _ in range(1200):  # until a worker of its own runs it (a start takes seconds)
            await asyncio.sleep(0.05)
            if set(cache.worker_pids()) - set(killed) or second.done():
                break
        state = (second.done(), cache.worker_pids())
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        cheap = await cache.compile_async(StructuredOutputsParams(choice=["a", "b"]))
        await cache.aclose()
        return killed, state, cheap

    killed, (second_done, pids_after), cheap = asyncio.run(main())
    assert killed and not second_done  # still compiling: not cancelled with the first
    assert pids_after and not set(killed) & set(pids_after)  # a worker of its own
    assert cheap is not None


@pytest.mark.slow  # the embedded model's tokenizer, and worker processes' starts
def test_a_workers_start_is_not_charged_to_a_compiles_deadline_nor_its_failure_to_the_client(
        embedded_model_dir, tmp_path, monkeypatch):
    """A compile worker's start (Python, xgrammar's import) has a bound of its own: a slow start
    (3 s here, made so by a sitecustomize on the worker's path) does not refuse a cheap spec
    whose compile deadline is 2 s, and a worker that cannot start at all is the server's
    failure (WorkerDidNotStart: UNAVAILABLE), not a 400 blaming the spec."""
    import asyncio

    from engine_worker.grammar import GrammarCompilerCache, WorkerDidNotStart
    from engine_worker.server.errors import KINDS
    from engine_worker.tokenizer import Tokenizer
    from quire.errors import ErrorKind

    tokenizer = Tokenizer(embedded_model_dir)
    slow, broken = tmp_path / "slow", tmp_path / "broken"
    slow.mkdir()
    broken.mkdir()
    (slow / "sitecustomize.py").write_text("import time\ntime.sleep(3.0)\n")
    (broken / "sitecustomize.py").write_text("import os\nos._exit(3)\n")

    def compile_with(path) -> object:
        monkeypatch.setenv("PYTHONPATH", str(path))
        cache = GrammarCompilerCache(lambda: tokenizer.hf, 49152, tokenizer.eos_token_ids,
                                     compile_timeout_s=2.0)

        async def main():
            try:
                return await cache.compile_async(StructuredOutputsParams(choice=["a", "b"]))
            finally:
                await cache.aclose()
        try:
            return asyncio.run(main())
        finally:
            cache.close()

    assert compile_with(slow) is not None
    with pytest.raises(WorkerDidNotStart, match="exit status 3"):
        compile_with(broken)
    kind = next(k for cls, k in KINDS if issubclass(WorkerDidNotStart, cls))
    assert kind == ErrorKind.UNAVAILABLE

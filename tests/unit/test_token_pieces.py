"""Token bytes and per-sequence token texts (logprobs' names for tokens), on a byte-level BPE
(the embedded SmolLM2's) and a SentencePiece-style BPE with byte fallback (Llama 2's kind)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from quire.token_pieces import TokenPieces
from quire.tokenizer import FastTokenizer

TEXTS = ["日本 🙂 héllo", " 日", "plain words, and a tab\tand\nnew line", "Ωμέγα — ½ ∑ 𝔘"]


def _check(backend: Tokenizer, text: str) -> list[str]:
    pieces = TokenPieces(backend)
    ids = backend.encode(text, add_special_tokens=False).ids
    # the tokens' own bytes join into the text's
    assert b"".join(pieces.bytes_of(i) for i in ids) == text.encode()
    # each token's text in the sequence joins into the text, partial characters as ""
    steps = pieces.text_steps()
    texts = [steps(i) for i in ids]
    assert "".join(texts) == backend.decode(ids, skip_special_tokens=False)
    for i, piece in zip(ids, texts):
        if not piece:  # partial alone: its bytes are no text by themselves
            alone = pieces.bytes_of(i)
            assert alone and alone.decode("utf-8", errors="replace").count("\ufffd") > 0
    return texts


def test_byte_level_bpe(embedded_model_dir):
    tokenizer = FastTokenizer.from_dir(embedded_model_dir)
    backend = tokenizer.backend
    partial = 0
    for text in TEXTS:
        texts = _check(backend, text)
        partial += texts.count("")
    assert partial >= 2  # "日" has no token of its own here: its bytes come in pieces
    # a special token is its text, in a sequence and alone
    eos = backend.token_to_id("<|im_end|>")
    assert tokenizer.pieces.bytes_of(eos) == b"<|im_end|>"
    steps = tokenizer.pieces.text_steps()
    assert [steps(i) for i in backend.encode("hi").ids] + [steps(eos)] == ["hi", "<|im_end|>"]


def _sentencepiece_with_byte_fallback() -> Tokenizer:
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("\u2581", "h", "i", "e", "l", "o", "é", "\u2581h", "\u2581hi", "\u2581he",
                 "ll", "llo"):
        vocab[word] = len(vocab)
    merges = [("\u2581", "h"), ("\u2581h", "i"), ("\u2581h", "e"), ("l", "l"), ("ll", "o")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return backend


def test_sentencepiece_byte_fallback():
    backend = _sentencepiece_with_byte_fallback()
    pieces = TokenPieces(backend)
    ids = backend.encode("hi 日 héllo", add_special_tokens=False).ids
    assert any(backend.id_to_token(i).startswith("<0x") for i in ids)  # bytes, not chars
    # its space mark is a space in the token's bytes (the decoder strips the first)
    assert b"".join(pieces.bytes_of(i) for i in ids) == " hi 日 héllo".encode()
    steps = pieces.text_steps()
    texts = [steps(i) for i in ids]
    assert "".join(texts) == backend.decode(ids) == "hi 日 héllo"
    assert texts.count("") == 2  # 日's first two bytes


def test_a_choices_first_token_keeps_its_space_after_the_prompt():
    """The router names a choice's tokens by the text each adds after the prompt, as the
    engine's detokenizer writes the text (primed with the prompt's last tokens): a
    SentencePiece token's leading space shows only after other text, so a choice decoded from
    nothing lost it, and its tokens no longer joined into the text."""
    from tokenizers.decoders import DecodeStream

    from quire.v1 import engine_pb2 as pb
    from router.openai_answer import OpenAIRequest

    backend = _sentencepiece_with_byte_fallback()
    ids = backend.encode("hi hello 日", add_special_tokens=False).ids
    prompt, output = ids[:1], ids[1:]
    engine = DecodeStream(skip_special_tokens=False)  # as the engine writes the text
    for token_id in prompt:
        engine.step(backend, token_id)
    text = "".join(engine.step(backend, t) or "" for t in output)
    assert text.startswith(" h")
    req = OpenAIRequest({"prompt": "hi", "logprobs": 0, "max_tokens": 9}, chat=False,
                        model_name="m", token_text=lambda t: backend.decode([t]),
                        pieces=TokenPieces(backend))
    req.saw(pb.GenerateResponse(request_id=req.id, prompt_token_ids=prompt))
    entries = [pb.PositionLogprobs(token_ids=[t], logprobs=[-1.0]) for t in output]
    logprobs = req.choice(0, text, entries, "length", chunk=False)["logprobs"]
    assert "".join(logprobs["tokens"]) == text
    assert all(text[at:at + len(t)] == t
               for at, t in zip(logprobs["text_offset"], logprobs["tokens"]))

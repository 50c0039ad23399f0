"""Incremental detokenization on a SentencePiece-style tokenizer (Metaspace: a word's leading space is
part of its token, and a sequence's first token loses it when decoded alone), built offline here."""

import itertools

import pytest
from spyre_runtime.engine.outputs import decode_output

CORPUS = "Hello world. The capital of France is Paris. Hello there, world of words." * 20


@pytest.fixture(scope="module")
def sp_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_the_first_output_token_keeps_its_leading_space(sp_tokenizer):
    ids = sp_tokenizer("Hello world of words", add_special_tokens=False)["input_ids"]
    split = len(sp_tokenizer("Hello", add_special_tokens=False)["input_ids"])
    prompt, output = ids[:split], ids[split:]
    assert sp_tokenizer.decode(output) == "world of words"  # the naive way loses the space
    assert decode_output(sp_tokenizer, prompt, output, skip_special_tokens=True) == " world of words"
    # token by token, the text only grows: what was streamed is never taken back
    texts = [decode_output(sp_tokenizer, prompt, output[:k], True) for k in range(1, len(output) + 1)]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


def test_special_tokens_in_the_context_do_not_leak(sp_tokenizer):
    bos = sp_tokenizer.bos_token_id
    world = sp_tokenizer(" world", add_special_tokens=False)["input_ids"]
    assert decode_output(sp_tokenizer, [bos], world, skip_special_tokens=True).strip() == "world"
    shown = decode_output(sp_tokenizer, [bos], [*world, sp_tokenizer.eos_token_id], skip_special_tokens=False)
    assert shown.endswith("</s>") and "<s>" not in shown

"""Mismatched target/drafter pairs are refused with one clear ValueError before any compute."""

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel

from .conftest import make_tiny_target


class FakeTokenizer:
    def __init__(self, vocab):
        self._vocab = vocab
        self.mask_token_id = None

    def get_vocab(self):
        return dict(self._vocab)


TOKENIZER = FakeTokenizer({f"t{i}": i for i in range(96)})
OTHER_TOKENIZER = FakeTokenizer({f"u{i}": i for i in range(96)})


def _count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def _drafter_for(target, **kwargs):
    return AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4, **kwargs).eval()


@pytest.mark.parametrize("path", [None, "dflash"])
@pytest.mark.parametrize(
    "make_pair, message",
    [
        (lambda: (make_tiny_target(), _drafter_for(make_tiny_target(hidden_size=32))), "hidden size"),
        (lambda: (make_tiny_target(), _drafter_for(make_tiny_target(vocab_size=80))), "vocabulary size"),
        (lambda: (make_tiny_target(num_layers=2), _drafter_for(make_tiny_target(num_layers=6))), "out of range"),
    ],
    ids=["hidden", "vocab", "layer-ids"],
)
def test_mismatched_pairs_fail_before_any_forward(make_pair, message, path):
    target, drafter = make_pair()
    target_calls, drafter_calls = _count_forwards(target), _count_forwards(drafter)
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, assistant_model=drafter, speculation_type=path)
    assert target_calls == [] and drafter_calls == []


def test_all_mismatches_are_listed_in_one_error():
    target = make_tiny_target(num_layers=2)
    drafter = _drafter_for(make_tiny_target(hidden_size=32, vocab_size=80, num_layers=6))
    with pytest.raises(ValueError) as error:
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, assistant_model=drafter)
    text = str(error.value)
    assert "hidden size" in text and "vocabulary size" in text and "out of range" in text


def test_tokenizer_mismatch_is_refused():
    target = make_tiny_target()
    drafter = _drafter_for(target, tokenizer=TOKENIZER)
    prompt = torch.tensor([[1, 2, 3]])
    ok = target.generate(prompt, max_new_tokens=4, assistant_model=drafter, tokenizer=TOKENIZER)
    assert ok.shape == (1, 7)
    calls = _count_forwards(target)
    with pytest.raises(ValueError, match="tokenizer fingerprint"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, tokenizer=OTHER_TOKENIZER)
    with pytest.raises(ValueError, match="assistant_tokenizer"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, tokenizer=TOKENIZER,
                        assistant_tokenizer=TOKENIZER)
    assert calls == []

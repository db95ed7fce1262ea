"""TinyGPT and the character corpus (ddp_lesson.gpt)."""
from __future__ import annotations

import pytest
import torch

from ddp_lesson.gpt import GPTConfig, TinyGPT, get_batch, load_corpus, tokens_per_step


def test_corpus_is_pydoc_topics_with_sorted_vocabulary():
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    c = load_corpus()
    assert c.text == text
    assert len(c.data) == len(text)
    assert c.chars == sorted(set(text))
    assert c.vocab_size == len(set(text))
    assert c.decode(c.data[:200]) == text[:200]
    assert c.encode("abc") == [c.chars.index(ch) for ch in "abc"]


def test_corpus_numbers_printed_by_notebook():
    # CPython 3.11's pydoc_data.topics (the notebook prints these)
    c = load_corpus()
    import sys

    if sys.version_info[:2] != (3, 11):
        pytest.skip("the stored numbers are those of CPython 3.11's pydoc_data")
    assert (len(c.text), c.vocab_size) == (465048, 103)


def _expected_params(V, T, C, L):
    block = (
        2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    )
    return V * C + T * C + L * block + 2 * C + C * V


def test_tinygpt_shapes_and_parameter_count():
    torch.manual_seed(0)
    m = TinyGPT(vocab_size=103)
    assert m.num_params() == _expected_params(103, 32, 64, 2) == 115328
    assert len(list(m.parameters())) == 29
    x = torch.randint(0, 103, (4, 32))
    logits, loss = m(x, x)
    assert logits.shape == (4, 32, 103)
    # an untrained model predicts close to uniform: loss near ln(V)
    assert abs(loss.item() - torch.log(torch.tensor(103.0)).item()) < 0.2
    assert f"{torch.log(torch.tensor(103.0)).item():.2f}" == "4.63"  # printed by notebook 08
    assert m(x)[1] is None


def test_attention_is_causal():
    torch.manual_seed(0)
    m = TinyGPT(GPTConfig(vocab_size=10, block_size=8, n_embd=16, n_head=2, n_layer=1))
    x = torch.randint(0, 10, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % 10
    # changing tokens 5.. must not change the logits at positions 0..4
    assert torch.allclose(m(x)[0][:, :5], m(y)[0][:, :5])
    assert not torch.allclose(m(x)[0][:, 5:], m(y)[0][:, 5:])


def test_get_batch_targets_are_shifted_inputs():
    data = torch.arange(100)
    x, y = get_batch(data, 3, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 10)
    assert torch.equal(y, x + 1)
    with pytest.raises(ValueError, match="block_size 100"):
        get_batch(data, 1, 100)


def test_config_errors_name_numbers():
    with pytest.raises(ValueError, match="n_head 3 does not divide n_embd 64"):
        GPTConfig(n_head=3)
    with pytest.raises(ValueError, match="sequence length 40 is longer than block_size 32"):
        TinyGPT()(torch.zeros(1, 40, dtype=torch.long))


def test_tokens_per_step():
    assert tokens_per_step(4, 32, 2) == 256
    assert tokens_per_step(4, 2048, 64) == 524288
    assert tokens_per_step(4, 2048, 64, 6) == 3145728
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        tokens_per_step(1, 1, 0)

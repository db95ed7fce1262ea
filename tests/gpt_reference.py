"""The single-process TinyGPT baseline that the ZeRO and FSDP tests compare against.

Plain AdamW on one process over the whole global batch, with the same data order the labs use
(batch ``step`` drawn from a generator seeded 1000 + step): an independent reference, written
without any of the package's distributed code.
"""
import torch

from ddp_lesson.gpt import TinyGPT, get_batch, load_corpus


def single_process_losses(steps, world_size, batch_per_rank=4, block_size=32):
    """Independent baseline: one process, the whole global batch, plain AdamW."""
    corpus = load_corpus()
    torch.manual_seed(0)
    m = TinyGPT(vocab_size=corpus.vocab_size)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = get_batch(corpus.data, batch_per_rank * world_size, block_size, g)
        _, loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def lab_value(lines, key):
    """The value of the one ``key: value`` line a lab printed (the ZeRO and FSDP labs)."""
    hits = [line.split(": ", 1)[1] for line in lines if line.startswith(key + ":")]
    assert len(hits) == 1, (key, lines)
    return hits[0]

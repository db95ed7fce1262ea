"""TinyGPT: a small decoder-only transformer, and a character corpus that needs no download.

The model follows GPT-2's layout (Radford et al. 2019) as nanoGPT writes it (Karpathy,
https://github.com/karpathy/nanoGPT): token + position embeddings, ``n_layer`` pre-norm blocks
of causal self-attention and an MLP, a final LayerNorm and a linear head to the vocabulary.
Shapes: ``B`` batch, ``T`` sequence length (``<= block_size``), ``C`` = ``n_embd``,
``V`` = ``vocab_size``.

The corpus is the documentation text in :mod:`pydoc_data.topics` (about 465k characters,
shipped with CPython), joined in sorted topic order and tokenised one character per token with
the sorted unique characters as the vocabulary, so every machine builds the same ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "CharCorpus", "load_corpus", "get_batch", "tokens_per_step"]


@dataclass(frozen=True)
class GPTConfig:
    """TinyGPT's size: ``vocab_size`` V, ``block_size`` (the longest context T), ``n_embd`` C
    (the residual stream's width), ``n_head`` (divides ``n_embd``), ``n_layer`` blocks."""

    vocab_size: int = 103
    block_size: int = 32
    n_embd: int = 64
    n_head: int = 4
    n_layer: int = 2

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head {self.n_head} does not divide n_embd {self.n_embd}")
        for name in ("vocab_size", "block_size", "n_embd", "n_head", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention, token t attending to tokens 0..t; ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, n_head, T, C / n_head)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; ``(B, T, C)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-style decoder-only language model, small enough for CPU lessons (``cfg``, or
    :class:`GPTConfig`'s fields as keywords).

    ``forward(idx, targets=None)``: ``(B, T)`` int64 ids, ``T <= block_size`` (ValueError
    otherwise) -> ``(logits, loss)``, logits ``(B, T, V)``, loss the mean next-token
    cross-entropy against ``(B, T)`` ``targets`` (None without). GPT-2's init (normal, std
    0.02) from torch's global generator: seed it first and every rank's copy is equal.
    """

    def __init__(self, cfg: GPTConfig | None = None, **kwargs):
        super().__init__()
        cfg = cfg if cfg is not None else GPTConfig(**kwargs)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss

    def num_params(self) -> int:
        """Number of parameter elements."""
        return sum(p.numel() for p in self.parameters())


@dataclass
class CharCorpus:
    """A character-level corpus: ``text``, its vocabulary ``chars`` (sorted unique characters,
    id i is ``chars[i]``) and ``data``, ``(len(text),)`` int64 ids."""

    text: str
    chars: list[str]
    data: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        """Characters -> ids. Raises KeyError for a character outside the vocabulary."""
        index = {c: i for i, c in enumerate(self.chars)}
        return [index[c] for c in s]

    def decode(self, ids) -> str:
        """Ids -> characters."""
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus(text: str | None = None) -> CharCorpus:
    """The :mod:`pydoc_data.topics` documentation (or ``text``) as a :class:`CharCorpus`:
    topics joined with newlines in sorted key order. Deterministic, no download."""
    if text is None:
        from pydoc_data.topics import topics

        text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    return CharCorpus(text=text, chars=chars, data=data)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``data``: inputs ``x`` and next-token targets ``y``.

    ``data``: ``(N,)`` int64 ids, ``N > block_size``; ``generator`` draws the window starts
    (the same state gives the same batch on every rank).

    Returns:
        ``(x, y)``, both ``(B, T)`` int64; ``y[:, t] == x[:, t + 1]`` inside the window.

    Raises:
        ValueError: the corpus is not longer than ``block_size``.
    """
    if len(data) <= block_size:
        raise ValueError(f"corpus of {len(data)} tokens is too short for block_size {block_size}")
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block_size] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts.tolist()])
    return x, y


def tokens_per_step(micro_batch: int, block_size: int, world_size: int,
                    grad_accum_steps: int = 1) -> int:
    """Global batch in tokens: sequences per rank x tokens per sequence x ranks x accumulation.

    Language models state batches in tokens (GPT-3 175B: 3.2M, Brown et al. 2020, Table 2.1):
    a sequence of T tokens carries T next-token predictions. ValueError for a count below 1.
    """
    for name, v in (("micro_batch", micro_batch), ("block_size", block_size),
                    ("world_size", world_size), ("grad_accum_steps", grad_accum_steps)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return micro_batch * block_size * world_size * grad_accum_steps

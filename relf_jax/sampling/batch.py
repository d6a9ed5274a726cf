"""Batch sampling shared by every batch sampler (AR, speculative, block diffusion, ReLF): prompts
cut into fixed-size chunks (one compiled shape), the first chunk run once untimed (warm-up), each
reply cut at its stop token, and the result as `Samples`."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Optional

import jax

from relf_jax.data.tokenizer import encode_prompt
from relf_jax.errors import UserError


@dataclasses.dataclass
class Samples:
    texts: list[str]  # decoded replies (EOS excluded)
    token_ids: list[list[int]]
    complete: list[bool]  # reply ended with EOS
    seconds: float  # decode wall time, compilation excluded
    tokens: int  # generated tokens (EOS included)
    target_forwards: int = 0  # target forward passes (AR: one per token)
    denoise_steps: int = 0  # block diffusion: denoising steps (target_forwards less one refresh per block)
    denoise_commits: int = 0  # block diffusion: positions committed (all positions of the decoded blocks)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def tau(self) -> float:
        """Tokens per target forward pass (1 for AR decoding)."""
        return self.tokens / max(self.target_forwards, 1)


def prompt_ids(tok, prompts: Optional[Sequence[str]], n: int) -> list[list[int]]:
    """The token ids of `prompts` (`encode_prompt`: BOS when the tokenizer's prompts start with
    one); None: `n` empty prompts, i.e. fresh conversations. No prompts at all is a `UserError`."""
    prompts = list(prompts) if prompts is not None else [""] * n
    if not prompts:
        raise UserError("no prompts to sample from")
    return [encode_prompt(tok, p) for p in prompts]


def fill_chunk(rows: Sequence[Any], size: int, filler: Any) -> list[Any]:
    """`rows` filled up to `size` with `filler`: every chunk has the one compiled batch shape."""
    return list(rows) + [filler] * (size - len(rows))


def timed_chunks(n: int, batch_size: int, key: jax.Array, prepare: Callable[[int], Any],
                 run: Callable[[Any, jax.Array], Any], *, warmup: bool = True) -> Iterator[tuple[Any, Any, float]]:
    """Run `n` rows `batch_size` at a time: for each chunk start, ``inputs = prepare(start)`` and
    ``out = run(inputs, key)`` with a fresh split of `key`; the first chunk runs once more before
    the clock starts when `warmup` (its compilation is not timed). Yields (inputs, out, seconds)
    with `out` ready (blocked on)."""
    for start in range(0, n, batch_size):
        inputs = prepare(start)
        key, sub = jax.random.split(key)
        if warmup and start == 0:
            jax.block_until_ready(run(inputs, sub))
        t0 = time.perf_counter()
        out = jax.block_until_ready(run(inputs, sub))
        yield inputs, out, time.perf_counter() - t0


def cut_at_stop(ids: Sequence[int], stops: Collection[int], drop: Collection[int] = ()) -> tuple[list[int], bool]:
    """(body, done): the tokens of `ids` before the first of `stops` (done when one is found),
    without the ids in `drop` (pad, BOS)."""
    body = []
    for t in ids:
        t = int(t)
        if t in stops:
            return body, True
        if t not in drop:
            body.append(t)
    return body, False


def strip_stop(reply: Sequence[int], stops: Collection[int]) -> tuple[list[int], bool]:
    """(body, done) of a reply that a decoder ended at its stop token: done when the last token
    is one of `stops`, the body without it."""
    reply = [int(t) for t in reply]
    done = bool(reply) and reply[-1] in stops
    return (reply[:-1] if done else reply), done


def collect(tok, replies: Sequence[tuple[list[int], bool]], **fields: Any) -> Samples:
    """`Samples` of the (body, done) replies, decoded with `tok`; `tokens` (unless given) counts
    each body and its stop token."""
    fields.setdefault("tokens", sum(len(body) + int(done) for body, done in replies))
    return Samples(texts=[tok.decode(body) for body, _ in replies], token_ids=[body for body, _ in replies],
                   complete=[done for _, done in replies], **fields)


def samples_from_rows(tok, rows, *, seconds: float = 0.0, target_forwards: int = 0) -> Samples:
    """Whole generated rows (token ids from position 0, as ReLF writes them) as `Samples`: a
    leading BOS dropped, cut at the first EOS (complete) and pad / BOS ids removed."""
    replies = []
    for row in rows:
        ids = [int(i) for i in row]
        if ids and ids[0] == tok.bos_id:
            ids = ids[1:]
        replies.append(cut_at_stop(ids, {tok.eos_id}, (tok.pad_id, tok.bos_id)))
    return collect(tok, replies, seconds=seconds, target_forwards=target_forwards)

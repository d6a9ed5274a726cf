"""`MockEngine`: no model; echoes the last user turn one token per step, optionally sleeping a
fixed time per step. Its outputs are known by hand, for scheduler and server tests. `ByteTokenizer`:
UTF-8 bytes as tokens."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

from relf_jax.errors import UserError
from relf_jax.serving.engine_api import Engine, Prefix, StepOutput


class ByteTokenizer:
    """UTF-8 bytes as tokens, for the mock engine: pad 0, eos 1, bos 2, unk 3, ``<user>`` 4,
    ``<assistant>`` 5, byte b -> 6 + b."""

    pad_id, eos_id, bos_id, unk_id = 0, 1, 2, 3
    MARKERS: ClassVar[dict[str, int]] = {"<user>": 4, "<assistant>": 5}
    vocab_size = 6 + 256

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserError(f"the text holds a lone surrogate at character {e.start}: not valid Unicode") from None
        out: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(m), m) for m in self.MARKERS if m in rest]
            if not hits:
                out += [6 + b for b in rest.encode("utf-8")]
                break
            i, m = min(hits)
            out += [6 + b for b in rest[:i].encode("utf-8")] + [self.MARKERS[m]]
            rest = rest[i + len(m):]
        return out

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.MARKERS.items()}
        parts, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= 6:
                buf.append(i - 6)
            elif i in names:
                parts.append(buf.decode("utf-8", "replace") + names[i])
                buf = bytearray()
        return "".join(parts) + buf.decode("utf-8", "replace")

    def piece_to_id(self, piece: str) -> int:
        return self.MARKERS.get(piece, self.unk_id)


class MockEngine(Engine):
    """No model: the reply is the last user turn of the prompt (between the last ``<user>`` and
    the ``<assistant>`` after it, spaces trimmed), one token per step, then EOS, or the prompt's
    bytes after BOS when it has no ``<user>``. Each step sleeps `step_s` seconds (simulated
    model time, counted as model time), so tests can hold requests in slots for a known time.
    """

    def __init__(self, num_slots: int = 4, *, step_s: float = 0.0, max_context: int = 512, name: str = "mock"):
        self.name, self.num_slots, self.step_s, self.max_context = name, num_slots, step_s, max_context
        self.tokenizer = ByteTokenizer()
        self.stop_ids = (self.tokenizer.eos_id,)

    def reply_for(self, prompt: Sequence[int]) -> list[int]:
        """The tokens the mock answers `prompt` with (EOS last)."""
        ids = [i for i in prompt if i != self.tokenizer.bos_id]
        user, asst = ByteTokenizer.MARKERS["<user>"], ByteTokenizer.MARKERS["<assistant>"]
        if user in ids:
            ids = ids[len(ids) - ids[::-1].index(user):]
            if asst in ids:
                ids = ids[:ids.index(asst)]
        space = 6 + ord(" ")
        while ids and ids[0] == space:
            ids = ids[1:]
        while ids and ids[-1] == space:
            ids = ids[:-1]
        return ids + [self.tokenizer.eos_id]

    def init_state(self):
        return [None] * self.num_slots

    def prefill(self, prompt, params):
        reply = self.reply_for(prompt)
        return Prefix(data=reply[1:], tokens=reply[:1], done=len(reply) == 1)

    def insert(self, prefix, state, slot):
        state = list(state)
        state[slot] = list(prefix.data)
        return state

    def free(self, state, slot, stopped=False):
        state = list(state)
        state[slot] = None
        return state

    def generate(self, state):
        t0 = time.perf_counter()
        if self.step_s:
            time.sleep(self.step_s)
        toks, done, new = [], [], []
        for rest in state:
            if not rest:
                toks.append([]), done.append(False), new.append(None)
                continue
            toks.append(rest[:1]), done.append(len(rest) == 1), new.append(rest[1:] or None)
        return new, StepOutput(tokens=toks, done=done, model_s=time.perf_counter() - t0)

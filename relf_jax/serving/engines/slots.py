"""The slot and span machinery the model engines share: a slot's sampler state (a batch of
one, vmapped over slots), the host record of which sampling features the held slots use
(`Held`), the KV-cache spans fitted to the occupied slots (`Spans`; `slot_engine.SlotEngine` uses them), stepping only
the occupied slots (`subset_slots`), several sampler steps per call (`run_steps`), and the
per-request sampling settings as the jitted calls take them.

Each slot holds the sampler's state for a batch of one, so per-request settings (temperature,
top-p, top-k, min-p, the penalties and their token counts, the logit bias, seed) are traced per
slot, a slot's tokens do not depend on what the other slots hold, and the same seed gives the
same reply whatever the batch. A prefill's buffers span the model's whole context, so prefixes
of any prompt bucket fit any slot; the prompt is padded to a power-of-two bucket. The AR and
speculative engines cut their slots' KV caches to the span the occupied slots need (`Spans`):
one compilation of `generate` per span (and per number of stepped slots, `subset_slots`), of
the fused prefill per bucket and span. Token decisions run in float32 (the samplers' rule).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.errors import UserError
from relf_jax.serving.engine_api import Engine, Pending, Prefix, RequestParams


def bucket_for(length: int, limit: int) -> int:
    """`relf_jax.sampling.autoregressive.prompt_bucket` (power of two), capped at `limit`."""
    from relf_jax.sampling.autoregressive import prompt_bucket

    return max(length, min(prompt_bucket(length), limit))


def shortest_in_bucket(length: int) -> int:
    """The shortest prompt padded to the same bucket as one of `length` tokens."""
    from relf_jax.sampling.autoregressive import prompt_bucket

    b = prompt_bucket(length)
    return 1 if b == prompt_bucket(1) else b // 2 + 1


def set_slot(state, new, slot):
    """`state` with `new` (a batch of one) in `slot`; a leaf of `new` longer than the state's
    (a prefill's KV cache over the whole context, `Spans`) is cut to it."""
    return jax.tree.map(lambda s, n: s.at[slot].set(n[tuple(slice(0, d) for d in s.shape[1:])].astype(s.dtype)),
                        state, new)


def stack_slots(tree, n: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n,) + jnp.shape(x)).copy(), tree)


def first_prefix(engine: Engine, params: RequestParams, t0: float, first, done, prompt_len: int,
                  data=None, lp=None) -> Prefix:
    """The Prefix of a prefill that samples the first token (AR, speculative), `t0` its start:
    `first`, `done` (device scalars) and `lp` (the reported log-probs or None) come to the host
    in one copy."""
    first, done, lp = jax.device_get((first, done, lp))
    first, done = int(first), bool(done)
    return Prefix(data=data, tokens=[first], done=done or first in engine.stop_ids,
                  model_s=time.perf_counter() - t0, features=params.features(), prompt_len=prompt_len,
                  log_probs=None if lp is None else [lp_entry(np.asarray(lp, np.float32).reshape(-1))])


def done_at_stop_only(st, lengths, eos_id: int):
    """The sampler state of an engine prefill with `done` set by the first token alone (EOS).

    An engine's prefill settings size the cache to the whole context (``max_new_tokens`` =
    context - prompt bucket), so the sampler's own "one new token left" stop would end a prompt
    padded close to the context after its first token. The engines stop on length themselves:
    the step at the context's end, the batcher at the request's ``max_tokens``."""
    first = jnp.take_along_axis(st.tokens, lengths[:, None], axis=1)[:, 0]
    return dataclasses.replace(st, done=first == eos_id)


def lp_entry(row: np.ndarray) -> tuple[float, list[tuple[int, float]]]:
    """(the token's log-prob, [(id, log-prob)] of the most probable) from a float32 row of
    `processors.top_log_probs`."""
    n = (row.shape[0] - 1) // 2
    return float(row[0]), list(zip(row[1:1 + n].astype(np.int64).tolist(), row[1 + n:].tolist()))


def float_bits(x: jax.Array) -> jax.Array:
    """float32 -> int32 bit patterns (log-probs travel in a step's int32 output rows)."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def sparse_bias(params: RequestParams) -> tuple[np.ndarray, np.ndarray]:
    """A request's logit_bias as (ids, values), padded with zero entries to a power of two >= 8
    (one compilation of a prefill per size)."""
    n = 8
    while n < len(params.logit_bias):
        n *= 2
    ids, vals = np.zeros((n,), np.int32), np.zeros((n,), np.float32)
    for i, (t, b) in enumerate(params.logit_bias):
        ids[i], vals[i] = t, b
    return ids, vals


def request_knobs(p: RequestParams, engine_top_k: int) -> dict:
    """A request's traced sampling settings as host scalars (what the jitted prefills take)."""
    return {"temperature": np.float32(p.temperature), "top_k": np.int32(p.top_k or engine_top_k),
            "top_p": np.float32(p.top_p), "min_p": np.float32(p.min_p),
            "repetition": np.float32(p.repetition_penalty), "frequency": np.float32(p.frequency_penalty),
            "presence": np.float32(p.presence_penalty)}


def request_sampling(ar, knobs: dict, bias_ids, bias_vals, vocab: int):
    """(Traced) `TracedSampling` of one request from `request_knobs`, every field present (a
    slot's state has one structure whatever its request uses; `static_sampling` drops the
    unused ones)."""
    from relf_jax.sampling import processors

    pen = processors.Penalties(bias=jnp.zeros((vocab,), jnp.float32).at[bias_ids].add(bias_vals),
                               repetition=knobs["repetition"], frequency=knobs["frequency"],
                               presence=knobs["presence"])
    return ar.TracedSampling(knobs["temperature"], knobs["top_k"], knobs["top_p"], knobs["min_p"], pen)


def static_sampling(sp, features: frozenset, engine_top_k: int):
    """`sp` with the features no held slot uses replaced by Python off values (left out at
    trace time; see `Held`)."""
    pen = sp.penalties
    if pen is not None:
        pen = pen.off(bias="bias" not in features, penalties="penalties" not in features)
        if pen.bias is None and not pen.tracks:
            pen = None
    return sp.replace(top_k=sp.top_k if "top_k" in features else engine_top_k,
                      top_p=sp.top_p if "nucleus" in features else None,
                      min_p=sp.min_p if "min_p" in features else None, penalties=pen)


SPAN_MIN = 64  # the shortest cache `Spans` sizes the slots to


class Spans:
    """The length of the slots' KV caches in the AR and speculative engines, fitted to what the
    occupied slots need.

    A slot's cache could hold the whole context, but a short conversation fills only its
    start, and every step attends over all of it (the empty tail masked): at a 256-token
    context that attention was about half of a batch-8 NSD round of the `cpu` preset on CPU
    (profile). So the stacked caches are cut to a *span*, the shortest of `lengths` (powers of
    two from `SPAN_MIN`, then the context) that holds every position a step can reach: the state
    keeps an upper bound of each occupied slot's committed length (`Held.ends`: prompt + 1 at
    the prefill, + every token a step emits for it), and a step adds at most ``tokens_per_step``. The caches
    grow (zero-padded) before a step or an insert that needs more, and shrink (cut) when the
    occupied slots fit in half; a slot's cache beyond its length is masked, so cutting it loses
    nothing. Attending to a narrower cache (an XLA slice of a wider one) would copy the slice
    every step; resizing copies only when the span changes. One compilation of the step per
    span. Masked slots weigh exactly zero, so the logits are the full cache's up to float
    rounding (the sums run over fewer terms); the tests check that the tokens are the sampler's.
    """

    def __init__(self, max_context: int, advance: int):
        self.advance = advance
        self.pin: int | None = None  # a span `fit` returns whatever the slots need (`Engine.warmup`)
        lengths, n = [], SPAN_MIN
        while n < max_context:
            lengths.append(n)
            n *= 2
        self.lengths = tuple(lengths) + (max_context,)

    def fit(self, current: int, ends: Sequence[int], occupied, extra: int = 0) -> int:
        """The span for a step over the `occupied` slots, whose committed lengths are at most
        `ends` (`Held.ends`), and a slot about to hold `extra` committed tokens: `current` while
        it holds them and they do not fit in half of it."""
        if self.pin is not None:
            return self.pin
        need = max([ends[s] for s in occupied] + [extra]) + self.advance
        best = next((n for n in self.lengths if n >= need), self.lengths[-1])
        return current if best <= current and 2 * best > current else best


def resize_cache(cache, span: int):
    """Per layer (k, v) [..., S, Dh]: cut or zero-pad the S axis to `span`."""
    def one(x):
        s = x.shape[-2]
        if span <= s:
            return x[..., :span, :]
        return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, span - s), (0, 0)])
    return jax.tree.map(one, cache)


def free_all_slots(engine: Engine, state):
    """`state` with every slot released (an engine's initial state from one stacked prefix)."""
    for slot in range(engine.num_slots):
        state = engine.free(state, slot)
    return state


def pad_one(prompt: Sequence[int], pad_id: int, bucket: int):
    from relf_jax.sampling.autoregressive import pad_prompts_np

    return pad_prompts_np([list(prompt)], pad_id, bucket)


class Leaves:
    """A model's parameters as the flat tuple of their arrays, the form the engines pass to their
    jitted calls: flattening an `nnx.State` runs Python for every variable on each call (about
    0.2 ms per call for the `cpu` preset's 38 arrays, measured), a tuple of arrays is flattened
    in C++. `tree` rebuilds the State inside the traced function."""

    def __init__(self, params):
        leaves, self.treedef = jax.tree.flatten(params)
        self.leaves = tuple(leaves)

    def tree(self, leaves):
        """The State of `leaves`; a State (e.g. ``lm.params`` passed directly) is returned as it is."""
        return jax.tree.unflatten(self.treedef, leaves) if isinstance(leaves, tuple) else leaves


@flax.struct.dataclass
class Slot:
    """Per-slot sampler state (a batch of one) and its traced sampling settings."""

    state: Any
    sampling: Any


@dataclasses.dataclass(frozen=True)
class Held:
    """The state of an engine that samples with the processors: the device slots, and on the
    host which held slots use which sampling feature (`RequestParams.features`).

    `generate` compiles a feature (the nucleus filter's sort over the vocabulary, top-k, min-p,
    the penalties, the logit bias, the log-probs) only while a slot that uses it is held. The
    samplers skip a filter with a runtime ``lax.cond``, but under the engines' ``vmap`` over
    slots that cond becomes a select that always computes it -- the nucleus sort was measured
    at most of an NSD round's time on CPU.
    """

    slots: Any
    users: frozenset = frozenset()  # (slot, feature) pairs
    occupied: frozenset = frozenset()  # slots holding a request (see `subset_slots`)
    # per slot, an upper bound of its committed length (`Spans`). One list for a state and the
    # states made from it, updated in place: `Engine.collect` advances it and returns no state.
    ends: list[int] = dataclasses.field(default_factory=list, compare=False)

    @property
    def features(self) -> frozenset:
        """The features some held slot uses (a static argument of the engines' steps)."""
        return frozenset(f for _, f in self.users)

    def insert(self, slots, slot: int, features: frozenset) -> Held:
        return Held(slots, frozenset((s, f) for s, f in self.users if s != slot) | {(slot, f) for f in features},
                    self.occupied | {slot}, self.ends)

    def free(self, slots, slot: int) -> Held:
        self.ends[slot] = 0
        return Held(slots, frozenset((s, f) for s, f in self.users if s != slot), self.occupied - {slot}, self.ends)


def subset_slots(held: Held, num_slots: int, groups: int = 1) -> np.ndarray | None:
    """The slots a step should compute when few are occupied: the occupied ones, padded with free
    ones to `groups` times a power of two (one compilation per size; `groups`: the slot groups of
    the engine's mesh, which split every step's slots), or None when that size reaches
    `num_slots` (step them all).

    A step costs nearly the same whatever its slots hold (vmapped over all of them), so at low
    load a lone request would pay for a full batch: on the `cpu` preset one busy slot of 8
    decoded at 0.79 ms per AR token against 0.33 ms in a one-slot engine. Free slots are done,
    so stepping one as padding emits nothing."""
    occupied = sorted(held.occupied)
    size = groups
    while size < len(occupied):
        size *= 2
    if size >= num_slots:
        return None
    pad = [s for s in range(num_slots) if s not in held.occupied][:size - len(occupied)]
    return np.asarray(occupied + pad, np.int32)


def step_subset(step_all, *args, idx, features, **kw):
    """``step_all(*params, slots)`` on the slots `idx` only (gathered, stepped, written back;
    the arrays no held slot uses stay where they are, `park`)."""
    *params, slots = args
    slots, restore = park(slots, features)
    sub, out = step_all(*params, jax.tree.map(lambda x: x[idx], slots), features=features, **kw)
    return restore(jax.tree.map(lambda x, y: x.at[idx].set(y), slots, sub)), out


def expand_rows(rows: list, idx: np.ndarray | None, num_slots: int) -> list:
    """Per-slot output rows of a step over `idx` (None: all slots): the others emit nothing."""
    if idx is None:
        return rows
    blank = [[0] * len(rows[0][0]) for _ in rows[0]]
    full = [blank] * num_slots
    for j, slot in enumerate(idx.tolist()):
        full[slot] = rows[j]
    return full


def collect_rows(pending: Pending, num_slots: int) -> tuple[list, float, bool]:
    """(per-slot rows as Python ints, model seconds, ready_early) of a dispatched step (see `Pending`)."""
    t2 = time.perf_counter()
    early = pending.rows.is_ready()
    rows = expand_rows(np.asarray(pending.rows).tolist(), pending.idx, num_slots)  # one device-to-host copy
    t3 = time.perf_counter()
    model_s = (pending.t1 - pending.t0) + (t3 - t2) if early else t3 - pending.t0
    return rows, model_s, early


def engine_context(model_max: int, max_context: int | None) -> int:
    """An engine's context: the model's, or `max_context` below it (`loading.engine_for`'s docstring)."""
    if max_context is None:
        return model_max
    if not isinstance(max_context, int) or not 2 <= max_context <= model_max:
        raise UserError(f"max_context must be an integer in [2, {model_max}] (the model's context), "
                        f"got {max_context!r}")
    return max_context


def check_steps_per_call(n: int) -> int:
    """Sampler steps (AR tokens, speculative rounds) one `generate` call runs, in one jitted loop.

    More than one cuts the per-step host work (dispatch, the host copy, the batcher's
    bookkeeping, one streamed chunk per call) at the cost of a coarser stream and of requests
    joining or leaving only between calls. A slot stops inside the call at a stop token or the
    context end; tokens past a request's own end (max_tokens, a stop string) are dropped by the
    batcher. Every step is the sampler's own, so a request's tokens do not change.
    """
    if not isinstance(n, int) or n < 1:
        raise UserError(f"steps_per_call must be an integer >= 1, got {n!r}")
    return n


def park(slots: Slot, features: frozenset):
    """(slots without the per-slot vocabulary-sized arrays no held slot uses -- the penalties'
    token counts, the logit bias --, a function that puts them back unchanged). Carried through
    a step's ``while_loop`` (or gathered for `step_subset`) they would cost copies per call."""
    state, pen = slots.state, slots.sampling.penalties
    drop_counts = "penalties" not in features and state.counts is not None
    drop_bias = "bias" not in features and pen is not None and pen.bias is not None
    if drop_counts:
        slots = slots.replace(state=state.replace(counts=None, seen=None))
    if drop_bias:
        slots = slots.replace(sampling=slots.sampling.replace(penalties=pen.replace(bias=None)))

    def restore(new: Slot) -> Slot:
        if drop_counts:
            new = new.replace(state=new.state.replace(counts=state.counts, seen=state.seen))
        if drop_bias:
            new = new.replace(sampling=new.sampling.replace(penalties=new.sampling.penalties.replace(bias=pen.bias)))
        return new

    return slots, restore


def run_parked(step, slots: Slot, n: int, width: int, features: frozenset):
    """`run_steps` with the arrays no held slot uses left out of the loop (`park`)."""
    slots, restore = park(slots, features)
    slots, rows = run_steps(step, slots, n, width)
    return restore(slots), rows


def run_steps(step, slots: Slot, n: int, width: int):
    """Up to `n` calls of ``step(slots) -> (slots, row [num_slots, width] int32)`` in one
    ``lax.while_loop`` that stops early once no slot is active (so a request that ends does not
    pay for the rest of the call). Returns (slots, rows [num_slots, n, width]); rows of steps
    not run are zero (nothing emitted)."""
    num = slots.state.done.shape[0]

    def cond(c):
        i, sl, _ = c
        return (i < n) & jnp.any(~sl.state.done)

    def body(c):
        i, sl, out = c
        sl, row = step(sl)
        return i + 1, sl, out.at[i].set(row)

    _, slots, out = jax.lax.while_loop(cond, body, (jnp.int32(0), slots, jnp.zeros((n, num, width), jnp.int32)))
    return slots, jnp.moveaxis(out, 0, 1)

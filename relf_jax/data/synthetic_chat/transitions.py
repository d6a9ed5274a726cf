"""The SyntheticChat automaton's moves: local transitions ``T[v, r, r']`` and end-of-turn
probabilities ``eot[v, r]`` of the user and assistant turns, then the noise that gives every text
with a valid marker skeleton a finite probability."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from relf_jax.data.synthetic_chat.lexicon import SYN_TRANS

if TYPE_CHECKING:
    from relf_jax.data.synthetic_chat.grammar import GrammarConfig


def geometric_continue(mean: float) -> float:
    """Continue probability of a geometric on {1, 2, ...} with the given mean."""
    if mean < 1.0:
        raise ValueError(f"geometric mean must be >= 1, got {mean}")
    return 1.0 - 1.0 / mean


def _syntax_next(c: GrammarConfig, s: str) -> dict[str, float]:
    if not c.syntax:
        return {"NOUN": 1.0}
    return SYN_TRANS[s]


def _user_transitions(c: GrammarConfig, T: np.ndarray, v: int, syn, entry, sid) -> None:
    """The user turn's rows of ``T[v]``: opener words, content syntax, the cue, tail words."""
    T[v, sid["U_START"], sid["U_OPEN"]] += c.user_open_prob
    for s, p in entry.items():
        T[v, sid["U_START"], sid[f"U_{s}"]] += (1 - c.user_open_prob) * p
    q = geometric_continue(c.user_open_mean)
    T[v, sid["U_OPEN"], sid["U_OPEN"]] += q
    for s, p in entry.items():
        T[v, sid["U_OPEN"], sid[f"U_{s}"]] += (1 - q) * p
    q = geometric_continue(c.user_body_mean)
    for s in syn:
        for s2, p in _syntax_next(c, s).items():
            T[v, sid[f"U_{s}"], sid[f"U_{s2}"]] += q * p
        T[v, sid[f"U_{s}"], sid["U_CUE"]] += 1 - q
    T[v, sid["U_CUE"], sid["U_TAIL"]] += c.user_tail_prob
    T[v, sid["U_CUE"], sid["A_MARK"]] += 1 - c.user_tail_prob
    q = geometric_continue(c.user_tail_mean)
    T[v, sid["U_TAIL"], sid["U_TAIL"]] += q
    T[v, sid["U_TAIL"], sid["A_MARK"]] += 1 - q


def _assistant_transitions(c: GrammarConfig, T: np.ndarray, eot: np.ndarray, v: int, syn, entry, sid,
                           phrase_states) -> None:
    """The assistant turn's rows of ``T[v]`` and ``eot[v]``: open phrase, body with mid phrases,
    close phrase, end of turn."""
    def to_phrases(r, group, prob):
        n = len(phrase_states[group])
        for idx in phrase_states[group]:
            T[v, r, idx[0]] += prob / n

    o = c.open_prob[v] if phrase_states["open"] else 0.0
    to_phrases(sid["A_MARK"], "open", o)
    for s, p in entry.items():
        T[v, sid["A_MARK"], sid[f"A_{s}"]] += (1 - o) * p
    for idx in phrase_states["open"] + phrase_states["mid"]:
        for a, b in itertools.pairwise(idx):
            T[v, a, b] = 1.0
        for s, p in entry.items():
            T[v, idx[-1], sid[f"A_{s}"]] += p
    q = geometric_continue(c.reply_body_means[v])
    m = c.mid_prob[v] if phrase_states["mid"] else 0.0
    z = c.close_prob[v] if phrase_states["close"] else 0.0
    for s in syn:
        r = sid[f"A_{s}"]
        to_phrases(r, "mid", q * m)
        for s2, p in _syntax_next(c, s).items():
            T[v, r, sid[f"A_{s2}"]] += q * (1 - m) * p
        to_phrases(r, "close", (1 - q) * z)
        eot[v, r] = (1 - q) * (1 - z)
    for idx in phrase_states["close"]:
        for a, b in itertools.pairwise(idx):
            T[v, a, b] = 1.0
        eot[v, idx[-1]] = 1.0


def transitions(c: GrammarConfig, V: int, syn, entry: dict[str, float], sid: dict[str, int],
                phrase_states: dict[str, list[list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(T [V, R, R], eot [V, R]) before noise: `syn` the content sub-states, `entry` P(first
    sub-state), `sid` the index of each named local state, `phrase_states` the states of each
    phrase per group."""
    R = len(sid)
    T = np.zeros((V, R, R))
    eot = np.zeros((V, R))
    for v in range(V):
        _user_transitions(c, T, v, syn, entry, sid)
        _assistant_transitions(c, T, eot, v, syn, entry, sid, phrase_states)
    return T, eot


def add_noise(c: GrammarConfig, names, sid, entry, T: np.ndarray, eot: np.ndarray) -> None:
    """Every state of a turn may derail (prob noise_prob) into the turn's NOISE state, which
    emits any non-marker word uniformly and then stays, rejoins the content syntax, or ends the
    turn. This gives every text with a valid marker skeleton a finite probability."""
    nu = c.noise_prob
    V, R = T.shape[0], T.shape[1]
    user_role = [i for i, n in enumerate(names) if n.startswith("U_")]
    asst_role = [i for i in range(R) if i not in user_role]
    for v in range(V):
        for role, noise in ((user_role, sid["U_NOISE"]), (asst_role, sid["A_NOISE"])):
            for r in role:
                if r != noise:
                    T[v, r] *= 1.0 - nu
                    eot[v, r] *= 1.0 - nu
                    T[v, r, noise] += nu
        for pre, exit_to in (("U", sid["A_MARK"]), ("A", None)):
            r = sid[f"{pre}_NOISE"]
            T[v, r, r] = 0.5
            for s_, p in entry.items():
                T[v, r, sid[f"{pre}_{s_}"]] += 0.3 * p
            if exit_to is None:
                eot[v, r] = 0.2
            else:
                T[v, r, exit_to] += 0.2

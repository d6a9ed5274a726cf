"""Fixed token embeddings for ReLF: Hellinger-SVD (the method) and two ablation baselines.

Built once, in numpy float64, from corpus co-occurrence counts (methods.md section 1):

1. C[w, c] = how often c follows w within `window` positions; P = rownorm(C + smoothing).
2. M = sqrt(P): every row has unit L2 norm, and |M[a] - M[b]| = sqrt(2) x Hellinger(P[a], P[b]).
3. Truncated SVD M ~ U_d S_d V_d^T; E = U_d S_d (= M V_d, the rows of M in the top-d basis),
   sign of each component fixed, rows rescaled to one norm (it sets the flow's SNR).

Centring (``center``) is off by default. Rows of M already lie on the unit sphere, so without
centring the truncated rows keep norm ~1 and the final rescale is a small correction: E E^T
stays ~ norm^2 M M^T (Bhattacharyya affinities). Centring subtracts the mean row first (PCA),
which frees the first component from the shared "average distribution" direction but makes
row norms uneven, so the rescale moves common tokens (near the mean) furthest. Both are
available; the choice is a config value.

Vocabularies of tens of thousands of tokens (the small / medium / large presets) take the
sparse path: `cooccurrence_sparse` counts, and `hellinger_svd_embeddings(method="auto")` switches
to a randomized SVD that applies M through sparse products (M is never formed).

All builders return float32 [V, dim] arrays and are deterministic (same input -> same bits).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

KINDS = ("hellinger_svd", "gaussian", "one_hot_projection")


def _pairs(token_rows, vocab_size: int, window: int, ignore_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """All forward pairs (row[i], row[i + k]), k = 1..window, as two int64 arrays (w, c)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    ws, cs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    rows = token_rows if not isinstance(token_rows, np.ndarray) or token_rows.ndim == 2 else [token_rows]
    for row in rows:
        row = np.asarray(row, np.int64).reshape(-1)
        if row.size and (row.min() < 0 or row.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{row.min()}, {row.max()}]")
        for k in range(1, min(window, row.size - 1) + 1):
            w, c = row[:-k], row[k:]
            if ignore_id is not None:
                keep = (w != ignore_id) & (c != ignore_id)
                w, c = w[keep], c[keep]
            ws.append(w)
            cs.append(c)
    return np.concatenate(ws), np.concatenate(cs)


def cooccurrence_counts(
    token_rows: np.ndarray | Iterable[Sequence[int]],
    vocab_size: int,
    window: int = 1,
    *,
    ignore_id: int | None = None,
) -> np.ndarray:
    """Forward co-occurrence counts C [V, V] float64.

    C[w, c] counts the pairs (row[i], row[i + k]) = (w, c) for k = 1..window within each row
    (window 1 = next token). `token_rows` is a 2-D int array [N, S] or any iterable of token
    sequences (ragged rows allowed). Pairs touching `ignore_id` (e.g. padding) are skipped.
    """
    w, c = _pairs(token_rows, vocab_size, window, ignore_id)
    flat = np.bincount(w * vocab_size + c, minlength=vocab_size * vocab_size).astype(np.float64)
    return flat.reshape(vocab_size, vocab_size)


def hellinger_rows(counts: np.ndarray, smoothing: float = 1e-3) -> np.ndarray:
    """M = sqrt(rownorm(counts + smoothing)) [V, V] float64; every row has unit L2 norm."""
    counts = np.asarray(counts, np.float64)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"counts must be square [V, V], got shape {counts.shape}")
    if smoothing < 0 or np.any(counts < 0):
        raise ValueError("counts and smoothing must be non-negative")
    smoothed = counts + smoothing
    totals = smoothed.sum(axis=1, keepdims=True)
    if np.any(totals <= 0):
        raise ValueError("a token has no counts and smoothing is 0: its row of P is undefined")
    return np.sqrt(smoothed / totals)


def fix_signs(vectors: np.ndarray) -> np.ndarray:
    """Flip each column so that its entry of largest |value| (first such row) is positive."""
    rows = np.argmax(np.abs(vectors), axis=0)
    signs = np.sign(vectors[rows, np.arange(vectors.shape[1])])
    signs[signs == 0] = 1.0
    return vectors * signs


def rescale_rows(vectors: np.ndarray, norm: float) -> np.ndarray:
    """Rows of `vectors` [V, d] rescaled to L2 norm `norm`, returned as float32."""
    if not norm > 0:
        raise ValueError(f"norm must be positive, got {norm}")
    vectors = np.asarray(vectors, np.float64)
    lengths = np.linalg.norm(vectors, axis=1, keepdims=True)
    if np.any(lengths < 1e-12):
        bad = np.flatnonzero(lengths[:, 0] < 1e-12)[:5]
        raise ValueError(f"rows {bad.tolist()} are ~0 before rescaling: raise dim or disable centring")
    return (vectors * (norm / lengths)).astype(np.float32)


def _default_norm(dim: int, norm: float | None) -> float:
    # sqrt(dim): each coordinate of E[w] has unit RMS, like the N(0, I) noise it is mixed with.
    return float(np.sqrt(dim)) if norm is None else float(norm)


DENSE_SVD_MAX_VOCAB = 4096  # above this, hellinger_svd_embeddings uses the randomized SVD


def cooccurrence_sparse(
    token_rows: np.ndarray | Iterable[Sequence[int]],
    vocab_size: int,
    window: int = 1,
    *,
    ignore_id: int | None = None,
):
    """`cooccurrence_counts` as a ``scipy.sparse.csr_matrix`` [V, V] float64: memory grows with
    the number of distinct pairs, not V^2, so it works for 32k-token vocabularies."""
    import scipy.sparse as sp

    w, c = _pairs(token_rows, vocab_size, window, ignore_id)
    counts = sp.coo_matrix((np.ones(w.size, np.float64), (w, c)), shape=(vocab_size, vocab_size)).tocsr()
    counts.sum_duplicates()
    return counts


class HellingerOperator:
    """M = sqrt(rownorm(C + smoothing)) (optionally column-centred) as products, never stored.

    With r_i = sum_j C_ij + V * smoothing and u_i = sqrt(smoothing / r_i), every entry of row i
    where C is zero equals u_i, so M = S + u 1^T with S sparse (S_ij = sqrt((C_ij + smoothing)
    / r_i) - u_i on the non-zeros of C). Centring subtracts 1 mu^T, mu = M^T 1 / V.
    """

    def __init__(self, counts, smoothing: float, center: bool):
        import scipy.sparse as sp

        c = sp.csr_matrix(counts, dtype=np.float64)
        if c.shape[0] != c.shape[1]:
            raise ValueError(f"counts must be square [V, V], got shape {c.shape}")
        if smoothing < 0 or (c.nnz and c.data.min() < 0):
            raise ValueError("counts and smoothing must be non-negative")
        v = c.shape[0]
        totals = np.asarray(c.sum(axis=1)).reshape(-1) + v * smoothing
        if np.any(totals <= 0):
            raise ValueError("a token has no counts and smoothing is 0: its row of P is undefined")
        self.u = np.sqrt(smoothing / totals)
        row_of = np.repeat(np.arange(v), np.diff(c.indptr))
        s = c.copy()
        s.data = np.sqrt((c.data + smoothing) / totals[row_of]) - self.u[row_of]
        self.s, self.st = s, s.T.tocsr()
        self.shape = (v, v)
        self.mu = self.rmatvec(np.ones((v, 1)))[:, 0] / v if center else None

    def matvec(self, x: np.ndarray) -> np.ndarray:  # M x, x [V, k]
        out = self.s @ x + self.u[:, None] * x.sum(axis=0, keepdims=True)
        if self.mu is not None:
            out = out - (self.mu @ x)[None, :]
        return out

    def rmatvec(self, y: np.ndarray) -> np.ndarray:  # M^T y, y [V, k]
        out = self.st @ y + (self.u @ y)[None, :]
        if getattr(self, "mu", None) is not None:
            out = out - self.mu[:, None] * y.sum(axis=0, keepdims=True)
        return out


def randomized_svd_components(op, dim: int, *, oversample: int = 16, power_iters: int = 4,
                              seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(U_d [V, dim], S_d [dim]) of an operator with matvec / rmatvec (Halko, Martinsson and
    Tropp's randomized range finder with power iterations). Deterministic for a fixed seed."""
    v = op.shape[0]
    k = min(v, dim + oversample)
    omega = np.random.default_rng(seed).standard_normal((v, k))
    q, _ = np.linalg.qr(op.matvec(omega))
    for _ in range(power_iters):
        z, _ = np.linalg.qr(op.rmatvec(q))
        q, _ = np.linalg.qr(op.matvec(z))
    b = op.rmatvec(q).T  # Q^T M, [k, V]
    ub, sv, _ = np.linalg.svd(b, full_matrices=False)
    return (q @ ub)[:, :dim], sv[:dim]


def hellinger_svd_embeddings(
    counts,
    dim: int,
    *,
    smoothing: float = 1e-3,
    norm: float | None = None,
    center: bool = False,
    whiten: bool = False,
    method: str = "auto",
    seed: int = 0,
) -> np.ndarray:
    """Hellinger-SVD token embeddings E [V, dim] float32 from co-occurrence counts [V, V].

    E = U_d S_d of the (optionally column-centred) Hellinger matrix M = sqrt(P), or, with
    `whiten`, U_d sqrt(V) (every kept component with the same variance: decorrelated and
    whitened, so the small components that tell near-synonyms apart weigh as much as the first);
    rows rescaled to `norm` (default sqrt(dim)); then each column's largest-|value| entry is
    made positive. `counts` is a dense array or a scipy sparse matrix (`cooccurrence_sparse`).

    method "dense": exact SVD, O(V^2) memory and O(V^3) time (fine up to a few thousand
    tokens). "randomized": `randomized_svd_components` on M applied as sparse products
    (`HellingerOperator`), O(nnz(C) + V d) memory: the one for 32k vocabularies. "auto":
    dense up to `DENSE_SVD_MAX_VOCAB` tokens, else randomized.
    Components with tied singular values are only determined up to a rotation.
    """
    vocab_size = counts.shape[0]
    if not 1 <= dim <= vocab_size:
        raise ValueError(f"dim must lie in [1, {vocab_size}], got {dim}")
    if method == "auto":
        method = "dense" if vocab_size <= DENSE_SVD_MAX_VOCAB else "randomized"
    if method == "dense":
        dense = counts.toarray() if hasattr(counts, "toarray") else counts
        m = hellinger_rows(dense, smoothing)
        if center:
            m = m - m.mean(axis=0, keepdims=True)
        u, s, _ = np.linalg.svd(m, full_matrices=False)
        u, s = u[:, :dim], s[:dim]
    elif method == "randomized":
        u, s = randomized_svd_components(HellingerOperator(counts, smoothing, center), dim, seed=seed)
    else:
        raise ValueError(f"method must be 'auto', 'dense' or 'randomized', got {method!r}")
    components = u * np.sqrt(vocab_size) if whiten else u * s
    # Signs after the rescale, so the convention holds on the returned rows (flips are exact).
    return fix_signs(rescale_rows(components, _default_norm(dim, norm)))


def gaussian_embeddings(vocab_size: int, dim: int, seed: int = 0, norm: float | None = None) -> np.ndarray:
    """Ablation baseline: i.i.d. N(0, 1) rows [V, dim] float32, rescaled to `norm`."""
    rng = np.random.default_rng(seed)
    return rescale_rows(rng.standard_normal((vocab_size, dim)), _default_norm(dim, norm))


def one_hot_projection_embeddings(
    vocab_size: int, dim: int, seed: int = 0, norm: float | None = None
) -> np.ndarray:
    """Ablation baseline: one-hot vectors through a random orthogonal projection, [V, dim] f32.

    E[w] = Q^T e_w with Q [V, dim] of orthonormal columns (dim <= V: a random dim-dimensional
    subspace of the one-hot space) or orthonormal rows (dim > V: the one-hots rotated into
    R^dim, pairwise orthogonal). Rows rescaled to `norm`.
    """
    rng = np.random.default_rng(seed)
    if dim <= vocab_size:
        q, _ = np.linalg.qr(rng.standard_normal((vocab_size, dim)))
    else:
        q, _ = np.linalg.qr(rng.standard_normal((dim, vocab_size)))
        q = q.T
    return rescale_rows(q, _default_norm(dim, norm))


def make_embeddings(
    kind: str,
    *,
    vocab_size: int,
    dim: int,
    norm: float | None = None,
    seed: int = 0,
    counts: np.ndarray | None = None,
    smoothing: float = 1e-3,
    center: bool = False,
) -> np.ndarray:
    """Dispatch on `kind` (one of `KINDS`); Hellinger-SVD needs `counts` [V, V]."""
    if kind == "hellinger_svd":
        if counts is None or counts.shape != (vocab_size, vocab_size):
            raise ValueError(f"hellinger_svd needs counts of shape ({vocab_size}, {vocab_size})")
        return hellinger_svd_embeddings(counts, dim, smoothing=smoothing, norm=norm, center=center)
    if kind == "gaussian":
        return gaussian_embeddings(vocab_size, dim, seed, norm)
    if kind == "one_hot_projection":
        return one_hot_projection_embeddings(vocab_size, dim, seed, norm)
    raise ValueError(f"unknown embedding kind {kind!r}; expected one of {KINDS}")


def near_duplicate_share(table: np.ndarray, freq: np.ndarray, threshold: float = 1e-3) -> float:
    """Share of text mass (token frequencies `freq` [V]) whose nearest other embedding row lies at
    squared distance < `threshold`: tokens the singular logits can only tell apart at t near 1."""
    e = np.asarray(table, np.float64)
    sq = (e * e).sum(1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * e @ e.T
    np.fill_diagonal(d2, np.inf)
    near = d2.min(1) < threshold
    w = np.asarray(freq, np.float64)
    return float((w * near).sum() / max(w.sum(), 1e-300))

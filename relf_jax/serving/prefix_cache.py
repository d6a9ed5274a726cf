"""The serving engines' prefix cache: the keys and values of token prefixes kept after a
request ends, so that the next request that starts with the same tokens (the next turn of a
conversation, a shared system prompt) prefills only the rest of its prompt.

Two parts:

- `BlockTree`, on the host: a radix tree whose edges are fixed-size blocks of `block` tokens. A
  node is one cached block, keyed by (its parent node, its tokens), so a path from the root spells
  a prefix and a lookup walks the prompt block by block to its longest cached prefix. Only full
  blocks are cached; a prompt that diverges inside a block reuses the blocks before it. Eviction
  is least-recently-used among the leaves (a node's children hold keys computed after it, so
  a node is evicted only after its children).
- `PrefixCache`: the device pool the blocks live in, one array per layer and per model (the
  target's; a speculative engine's draft model's too), sized once from a memory budget, so the
  cache never holds more than that; a jitted scatter that copies a finished slot's blocks into the
  pool and a gather (`gather_cache`, traced inside the engines' prefills) that lays a prompt's
  cached blocks out as the first slots of its KV cache.

The cached keys and values are those the request computed (its prefill, then one decode step per
token), so a prefill from the cache agrees with a full prefill up to float rounding (the sums run
in another order); the engines' tests check that the replies are the same token for token.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.errors import UserError

BLOCK = 16  # tokens per cached block (vLLM's default block size)


@dataclasses.dataclass
class _Node:
    parent: int  # -1: the root
    tokens: tuple[int, ...]
    depth: int  # blocks from the root, this one included
    last_used: int = 0
    children: int = 0


class BlockTree:
    """The host index of the cached blocks: `num_blocks` pool entries of `block` tokens each."""

    def __init__(self, num_blocks: int, block: int):
        self.block = block
        self.num_blocks = num_blocks
        self.nodes: dict[int, _Node] = {}
        self.index: dict[tuple[int, tuple[int, ...]], int] = {}
        self.free_ids = list(range(num_blocks - 1, -1, -1))
        self._clock = 0
        self._leaves: list[tuple[int, int]] = []  # heap of (last_used, id); stale entries skipped
        self.evictions = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node_id: int, now: int) -> None:
        node = self.nodes[node_id]
        node.last_used = now
        if node.children == 0:
            heapq.heappush(self._leaves, (now, node_id))

    def match(self, tokens: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """The pool ids of the longest chain of cached blocks that `tokens` starts with (at most
        `max_blocks`), marked as used now."""
        ids, parent, now = [], -1, self._tick()
        limit = len(tokens) // self.block if max_blocks is None else min(max_blocks, len(tokens) // self.block)
        for i in range(limit):
            node_id = self.index.get((parent, tuple(tokens[i * self.block:(i + 1) * self.block])))
            if node_id is None:
                break
            ids.append(node_id)
            parent = node_id
        for node_id in ids:
            self._touch(node_id, now)
        return ids

    def insert(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Make every full block of `tokens` cached: returns (block index in `tokens`, pool id)
        of the blocks that were not (their keys and values are the caller's to write). Blocks
        already cached are marked as used. When the pool is full, least-recently-used leaves
        outside this chain are evicted; when none is left, the chain stops short."""
        now = self._tick()
        parent, chain, new = -1, set(), []
        for i in range(len(tokens) // self.block):
            key = (parent, tuple(int(t) for t in tokens[i * self.block:(i + 1) * self.block]))
            node_id = self.index.get(key)
            if node_id is None:
                node_id = self._allocate(chain)
                if node_id is None:
                    break
                self.nodes[node_id] = _Node(parent=parent, tokens=key[1], depth=i + 1)
                self.index[key] = node_id
                if parent >= 0:
                    self.nodes[parent].children += 1
                new.append((i, node_id))
            chain.add(node_id)
            parent = node_id
        for node_id in chain:
            self._touch(node_id, now)
        return new

    def _allocate(self, keep: set[int]) -> int | None:
        if not self.free_ids:
            self._evict_one(keep)
        return self.free_ids.pop() if self.free_ids else None

    def _evict_one(self, keep: set[int]) -> None:
        skipped = []
        while self._leaves:
            used, node_id = heapq.heappop(self._leaves)
            node = self.nodes.get(node_id)
            if node is None or node.children or node.last_used != used:
                continue  # stale: evicted, no longer a leaf, or used since
            if node_id in keep:
                skipped.append((used, node_id))
                continue
            del self.nodes[node_id]
            del self.index[(node.parent, node.tokens)]
            if node.parent >= 0:
                parent = self.nodes[node.parent]
                parent.children -= 1
                if parent.children == 0:
                    heapq.heappush(self._leaves, (parent.last_used, node.parent))
            self.free_ids.append(node_id)
            self.evictions += 1
            break
        for entry in skipped:
            heapq.heappush(self._leaves, entry)

    @property
    def used(self) -> int:
        return len(self.nodes)


def model_layout(model_cfg) -> tuple:
    """(layers, kv heads, head dim, dtype) of a model's KV cache (`relf_jax.models.causal_lm.init_cache`)."""
    from relf_jax.models.causal_lm import DTYPES

    return (model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.resolved_head_dim,
            jnp.dtype(DTYPES[model_cfg.dtype]))


def block_bytes(layouts: Sequence[tuple], block: int) -> int:
    """Bytes of one cached block over every model in `layouts` (keys and values)."""
    return sum(2 * n * kv * block * dh * dt.itemsize for n, kv, dh, dt in layouts)


def gather_cache(pool_model: tuple, ids: jax.Array, total: int) -> tuple:
    """(Traced) per layer (k, v) [1, K, total, Dh]: the pool blocks `ids` [n] laid end to end as
    the first ``n * block`` slots of a cache of `total` slots (cut or zero-padded to it)."""
    def one(p):
        blocks = p[ids]  # [n, K, block, Dh]
        n, kv, blk, dh = blocks.shape
        flat = jnp.moveaxis(blocks, 0, 1).reshape(kv, n * blk, dh)
        if n * blk >= total:
            flat = flat[:, :total]
        else:
            flat = jnp.pad(flat, ((0, 0), (0, total - n * blk), (0, 0)))
        return flat[None]
    return tuple((one(k), one(v)) for k, v in pool_model)


def _store(pool: tuple, caches: tuple, slot, src, dst):
    """`pool` with blocks `src` of `slot`'s caches written at pool ids `dst` (ids past the pool:
    dropped). caches: per model, per layer (k, v) [slots, 1, K, S, Dh]."""
    def one(p, c):
        x = c[slot, 0]  # [K, S, Dh]
        kv, s, dh = x.shape
        blk = p.shape[2]
        if s % blk:
            x = jnp.pad(x, ((0, 0), (0, blk - s % blk), (0, 0)))
        blocks = jnp.moveaxis(x.reshape(kv, -1, blk, dh), 1, 0)  # [S / block, K, block, Dh]
        vals = blocks[jnp.clip(src, 0, blocks.shape[0] - 1)].astype(p.dtype)
        return p.at[dst].set(vals, mode="drop")
    return tuple(tuple((one(pk, ck), one(pv, cv)) for (pk, pv), (ck, cv) in zip(pm, cm))
                 for pm, cm in zip(pool, caches))


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0  # prefills that looked a prompt up
    hits: int = 0  # prefills that reused at least one cached block
    hit_tokens: int = 0  # prompt tokens not prefilled because they were cached
    prompt_tokens: int = 0  # prompt tokens of the prefills that looked up


class PrefixCache:
    """Cached KV blocks of finished requests for an engine whose models have `layouts`
    (`model_layout` of the target, then of the draft model where there is one), in a pool of
    ``budget_bytes // block_bytes`` blocks of `block` tokens; `max_context` is the engine's.

    `lookup` finds a prompt's cached blocks (a prefill from them: `gather_cache`); `keep` copies
    a finished slot's full blocks into the pool.
    """

    def __init__(self, layouts: Sequence[tuple], budget_bytes: int, max_context: int, block: int = BLOCK):
        if block < 1:
            raise UserError(f"the prefix cache's block must be >= 1 token, got {block}")
        per_block = block_bytes(layouts, block)
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise UserError(f"a prefix cache of {budget_bytes / 2**20:.3g} MiB holds no block of {block} tokens "
                            f"({per_block / 2**20:.3g} MiB each for this model): give it more memory")
        self.block, self.max_context, self.block_bytes = block, max_context, per_block
        self.max_blocks = -(-max_context // block)  # a lookup's ids are padded to this many (one compilation)
        self.tree = BlockTree(num_blocks, block)
        # one placement for the pool, before and after every store: the jitted calls that take it
        # are then compiled once. (An uncommitted jnp.zeros, or a store's output placed by
        # propagation from the engine's mesh-sharded caches, keys another compilation each time the
        # pool's type changes, so the warm-up's programs would not be the ones serving uses.)
        self.sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        self.pool = jax.device_put(tuple(tuple((jnp.zeros((num_blocks, kv, block, dh), dt),
                                                jnp.zeros((num_blocks, kv, block, dh), dt))
                                               for _ in range(n)) for n, kv, dh, dt in layouts), self.sharding)
        self.stats = PrefixStats()
        self._store = jax.jit(_store, donate_argnums=(0,), out_shardings=self.sharding)

    @property
    def budget_bytes(self) -> int:
        """The pool's bytes (what the cache holds at most)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.pool))

    @property
    def bytes_in_use(self) -> int:
        return self.tree.used * self.block_bytes

    def lookup(self, prompt: Sequence[int]) -> tuple[int, np.ndarray]:
        """(cached prompt tokens `start`, pool ids [max_blocks] int32 padded with 0) of `prompt`'s
        longest cached prefix, leaving at least its last token to prefill (the first reply
        token's logits come from it). The caller may use fewer of the blocks; it reports what it
        used with `record`."""
        ids = self.tree.match([int(t) for t in prompt], max_blocks=(len(prompt) - 1) // self.block)
        out = np.zeros((self.max_blocks,), np.int32)
        out[:len(ids)] = ids
        return len(ids) * self.block, out

    def record(self, prompt_len: int, cached: int) -> None:
        """Count a prefill of `prompt_len` tokens whose first `cached` came from the cache."""
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_len
        if cached:
            self.stats.hits += 1
            self.stats.hit_tokens += cached

    def keep(self, caches: tuple, slot: int, tokens: Sequence[int]) -> None:
        """Cache the full blocks of `tokens`, whose keys and values (every one of them) are in
        `slot` of `caches` (per model, per layer (k, v) [slots, 1, K, S, Dh], with S >= len(tokens))."""
        new = self.tree.insert(tokens)
        if not new:
            return
        src = np.zeros((self.max_blocks,), np.int32)
        dst = np.full((self.max_blocks,), self.tree.num_blocks, np.int32)  # past the pool: dropped
        for j, (i, node_id) in enumerate(new):
            src[j], dst[j] = i, node_id
        self.pool = self._store(self.pool, caches, np.int32(slot), src, dst)

    def warmup(self, caches: tuple) -> None:
        """Compile `keep`'s copy for slot caches shaped like `caches` (every write dropped: nothing is stored)."""
        dropped = np.full((self.max_blocks,), self.tree.num_blocks, np.int32)
        self.pool = self._store(self.pool, caches, np.int32(0), np.zeros_like(dropped), dropped)

    def metrics(self) -> dict:
        """Counters for `/metrics` and the bench."""
        return {"lookups": self.stats.lookups, "hits": self.stats.hits, "hit_tokens": self.stats.hit_tokens,
                "prompt_tokens": self.stats.prompt_tokens, "evictions": self.tree.evictions,
                "blocks_used": self.tree.used, "blocks": self.tree.num_blocks,
                "bytes_in_use": self.bytes_in_use, "bytes_budget": self.budget_bytes, "block": self.block}

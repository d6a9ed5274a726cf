"""Named presets (`tiny` for CPU tests up to GPT-2 `large` shapes) and the command line's short keys."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests: trains in seconds.
    "tiny": {
        "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1,
        "model.mlp_dim": 64, "model.max_seq_len": 128,
        "data.num_train": 2000, "data.num_validation": 100, "data.seq_len": 64, "data.vocab_size": 512,
        "train.steps": 60, "train.batch_size": 8, "train.warmup_steps": 10, "train.eval_every": 30,
        "train.checkpoint_every": 30, "train.log_every": 5, "train.eval_batches": 2,
        "sample.num_samples": 8, "sample.batch_size": 8, "sample.max_new_tokens": 48,
    },
    # The demo on a 2-core CPU.
    "cpu": {},
    # A target past the CPU's caches (72 MB of float32 weights, 2x a 32 MiB L3): its decode step
    # reads its weights from memory, the regime speculative decoding is for (`bench spec --preset
    # cpu-wide`, docs/speculative.md). Width over depth; weights stored [out, in].
    "cpu-wide": {
        "model.d_model": 768, "model.num_layers": 2, "model.num_heads": 12, "model.num_kv_heads": 4,
        "model.mlp_dim": 3072, "model.weight_layout": "out_in",
        "train.steps": 600, "train.learning_rate": 1e-3, "train.eval_every": 100, "train.checkpoint_every": 100,
    },
    # GPT-2 small / medium / large shapes, for accelerators and pods.
    "small": {
        "model.d_model": 768, "model.num_layers": 12, "model.num_heads": 12, "model.num_kv_heads": 12,
        "model.mlp_dim": 2048, "model.max_seq_len": 1024, "model.dtype": "bfloat16",
        "data.seq_len": 1024, "data.vocab_size": 32768, "data.num_train": 1_000_000,
        "train.steps": 100_000, "train.batch_size": 256, "train.learning_rate": 6e-4,
        "train.warmup_steps": 2000, "train.eval_every": 2000, "train.checkpoint_every": 2000,
        "train.log_every": 50, "sample.max_new_tokens": 1024,
    },
    "medium": {
        "model.d_model": 1024, "model.num_layers": 24, "model.num_heads": 16, "model.num_kv_heads": 16,
        "model.mlp_dim": 2816, "model.max_seq_len": 1024, "model.dtype": "bfloat16",
        "data.seq_len": 1024, "data.vocab_size": 32768, "data.num_train": 1_000_000,
        "train.steps": 200_000, "train.batch_size": 256, "train.learning_rate": 3e-4,
        "train.warmup_steps": 2000, "train.eval_every": 2000, "train.checkpoint_every": 2000,
        "train.log_every": 50, "sample.max_new_tokens": 1024,
    },
    "large": {
        "model.d_model": 1280, "model.num_layers": 36, "model.num_heads": 20, "model.num_kv_heads": 20,
        "model.mlp_dim": 3456, "model.max_seq_len": 1024, "model.dtype": "bfloat16",
        "data.seq_len": 1024, "data.vocab_size": 32768, "data.num_train": 1_000_000,
        "train.steps": 300_000, "train.batch_size": 512, "train.learning_rate": 2.5e-4,
        "train.warmup_steps": 2000, "train.eval_every": 2000, "train.checkpoint_every": 2000,
        "train.log_every": 50, "sample.max_new_tokens": 1024,
    },
}

# Short spellings accepted on the command line.
ALIASES = {"model": "model.family", "draft": "speculative.draft", "nfe": "flow.nfe", "sampler": "flow.sampler"}

"""Training recipes for the decoder families: prepare the data and tokenizer of a run, then train
(or resume) an AR model (next-token loss) or a block-diffusion model (block masked diffusion on
whole-conversation rows) in ``<workdir>/<family>``. ReLF's recipe is `relf_jax.flow.recipes`."""

from __future__ import annotations

import dataclasses
import os

from relf_jax.config import Config
from relf_jax.data import pipeline
from relf_jax.data.prepare import prepare_data, prepare_tokenizer, row_mode
from relf_jax.errors import UserError
from relf_jax.train.loop import TrainResult, train
from relf_jax.train.objectives import masked_diffusion_loss, next_token_loss


def train_decoder(cfg: Config, *, mesh=None) -> TrainResult:
    """Prepare data and tokenizer, then train (or resume) the "ar" or "bd" model of `cfg` in its workdir."""
    if cfg.model.family not in ("ar", "bd"):
        raise UserError(f"model.family={cfg.model.family!r} is not a language model to train here; "
                        "the dws predictor trains with `relf-jax bench dws`")
    builder = prepare_data(cfg)
    tok = prepare_tokenizer(cfg, builder)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    d, t = cfg.data, cfg.train
    rows = row_mode(cfg)
    # block diffusion on packed rows: each document filled up to whole blocks
    align = model_cfg.block_size if model_cfg.family == "bd" and rows == "segments" else 1
    data = pipeline.make_iterator(builder, "train", tok, seq_len=d.seq_len, batch_size=t.batch_size,
                                  seed=t.seed, rows=rows, align=align, lookahead=d.pack_lookahead)
    evals = pipeline.eval_batches(builder, "validation", tok, seq_len=d.seq_len, batch_size=t.batch_size,
                                  max_batches=t.eval_batches, rows=rows, align=align, lookahead=d.pack_lookahead)
    loss = masked_diffusion_loss if model_cfg.family == "bd" else next_token_loss
    return train(cfg, model_cfg, loss, data, eval_data=evals,
                 workdir=os.path.join(cfg.workdir, model_cfg.family), mesh=mesh,
                 tokenizer_bytes=tok.to_bytes())

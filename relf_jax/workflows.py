"""Deprecated: the recipes that lived here now sit beside their method. This module only
re-exports them under their old names while the importers move; use ``import relf_jax as rj``
(`relf_jax.api`) or the homes below.

- data and tokenizer: `relf_jax.data.prepare`
- loading: `relf_jax.loading` (`load`, `load_model`), `relf_jax.checkpoint` (`latest_meta`)
- AR / block-diffusion batch sampling and streaming: `relf_jax.sampling.recipes`;
  the shared batch loop and `Samples`: `relf_jax.sampling.batch`
- speculative sampling, drafts, n-gram tables: `relf_jax.speculative.recipes`
- ReLF: `relf_jax.flow.recipes` (train, reflow), `relf_jax.flow.generate` (sampling),
  `relf_jax.flow.lengths` (the segment-length prior)
- AR / BD training: `relf_jax.train.recipes`; judges and reports: `relf_jax.eval.evaluate`
- JSON: `relf_jax.io.write_json`
"""

from relf_jax.api import train as train_lm  # noqa: F401
from relf_jax.checkpoint import LoadedModel, latest_meta  # noqa: F401
from relf_jax.data.prepare import (  # noqa: F401
    TOKENIZER_TRAIN_DOCS,
    data_dir,
    prepare_data,
    prepare_tokenizer,
    row_mode,
)
from relf_jax.data.tokenizer import encode_prompt  # noqa: F401
from relf_jax.eval.evaluate import (  # noqa: F401
    data_reference,
    evaluate_samples,
    exact_judge,
    model_judge,
    validation_loss,
)
from relf_jax.flow.generate import (  # noqa: F401
    flow_prompt_mode,
    flow_table,
    sample_relf,
    segment_residual,
)
from relf_jax.flow.generate import relf_tokens as _relf_tokens  # noqa: F401
from relf_jax.flow.lengths import (  # noqa: F401
    LENGTHS_FILE,
    draw_segment_lengths,
    flow_lengths,
    flow_segment_lengths,
    segment_rows,
)
from relf_jax.flow.recipes import (  # noqa: F401
    EMBEDDING_DOCS,
    flow_embeddings,
    flow_loss_settings,
    reflow,
    train_relf,
)
from relf_jax.flow.recipes import check_round_settings as _check_round_settings  # noqa: F401
from relf_jax.flow.recipes import finished as _finished  # noqa: F401
from relf_jax.io import write_json  # noqa: F401
from relf_jax.loading import load_model  # noqa: F401
from relf_jax.sampling.batch import Samples, samples_from_rows  # noqa: F401
from relf_jax.sampling.recipes import fit_new_tokens, sample_bd, stream_reply  # noqa: F401
from relf_jax.speculative.recipes import (  # noqa: F401
    NGRAM_DOCS,
    corpus_ngram_table,
    corpus_rows,
    draft_defaults,
    load_draft,
    sample,
    train_draft,
    trained_by_relf_jax,
)

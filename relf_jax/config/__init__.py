"""Typed, validated, layered configuration.

A run is described by one `Config`: a tree of frozen dataclasses (model, data, train, sample,
mesh, checkpoint). It is built in three layers:

1. defaults (the dataclass field defaults),
2. a named preset (`tiny`, `cpu`, `small`, `medium`, `large`),
3. `key=value` overrides, e.g. ``model.num_layers=4 train.steps=200 sample.temperature=0.8``.

Every override is checked: an unknown key or a value of the wrong type raises `ConfigError`
with a one-line message that names the key and the valid choices. Values are then validated
(`Config.validate`), so impossible settings (temperature < 0, top_p outside (0, 1], ...) fail
before any compute.
"""

from relf_jax.config.overrides import make_config, set_value
from relf_jax.config.presets import ALIASES, PRESETS
from relf_jax.config.schema import (
    PROPOSERS,
    Config,
    ConfigError,
    DataConfig,
    FlowConfig,
    MeshConfig,
    ModelConfig,
    SampleConfig,
    SpeculativeConfig,
    TrainConfig,
    coerce,
    from_dict,
    saved_model_config,
    validate_sampling,
)

__all__ = [
    "ALIASES",
    "PRESETS",
    "PROPOSERS",
    "Config",
    "ConfigError",
    "DataConfig",
    "FlowConfig",
    "MeshConfig",
    "ModelConfig",
    "SampleConfig",
    "SpeculativeConfig",
    "TrainConfig",
    "coerce",
    "from_dict",
    "make_config",
    "saved_model_config",
    "set_value",
    "validate_sampling",
]

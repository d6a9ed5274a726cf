"""Where programs run: the device mesh and logical-axis sharding rules, multi-process
initialisation (`sharding`), per-program XLA compiler options (`compile_options`), the persistent
compilation cache (`jit_cache`) and what `relf-jax info` reports (`info`)."""

"""The `relf-jax` subcommands: each module holds a few, as ``<name>_args(parser)`` (its options)
and ``<name>(args) -> exit status``; `experiments.launch.COMMANDS` is the table of them."""

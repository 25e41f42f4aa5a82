"""Measurements and the local-cluster launcher, run through `diloco-bench`.

Each module defining `add_arguments(parser)` and `run(args)` is a subcommand
(see bench/cli.py); bench/common.py holds the shared timing and output helpers.
"""

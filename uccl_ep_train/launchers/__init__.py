"""Running recipes: Hydra composition (recipes.py), validation, Megatron argv, run directories, local torchrun
and Slurm launchers, and the `train` subcommand (train_cli.py)."""

"""Stand-in for wandb (nanochat's base_train imports it; `--run dummy` never calls it)."""


def init(*args, **kwargs):
    raise RuntimeError("wandb stand-in: no network on this machine; run with --run dummy")

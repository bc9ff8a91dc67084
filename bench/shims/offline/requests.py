"""Stand-in for requests (nanochat's dataset.py imports it for downloads, which a run on local shards never makes)."""


def get(*args, **kwargs):
    raise RuntimeError("requests stand-in: no network on this machine")

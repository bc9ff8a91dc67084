"""Stand-in for PyYAML (nanochat's base_eval imports it; the CORE evaluation is off in the proof)."""


def safe_load(*args, **kwargs):
    raise RuntimeError("yaml stand-in: the CORE evaluation is not run here")

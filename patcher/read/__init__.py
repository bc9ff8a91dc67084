"""Stage 1, read: a script from disk, plain or the payload of a compressed exec wrapper, and written back."""

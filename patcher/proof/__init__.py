"""Proof: the patched loaders hand out the original's batches (verify), and how long the loop waits (bench)."""

"""Stage 5, check: does the output compile on the target Python, import, and stand on its own."""

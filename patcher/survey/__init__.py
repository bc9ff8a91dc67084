"""Stage 2, survey: read-only analysis of a script (loaders, call sites, evaluation loops) the transforms act on."""

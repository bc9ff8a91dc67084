"""Stage 4, render: the runtime templates cut to what one patch uses, in the script's own style."""

"""`python -m patcher.demo ORIGINAL PATCHED`: train both on synthetic shards, compare losses.

Used by `make demo`. Writes shards in the real fineweb format to a temporary
directory, runs each script for its default number of steps with `TRAIN_PREFETCH=1`
and `TRAIN_PREFETCH=0`, and prints whether every `step:N train_loss:X` line matches
the original's bit for bit. Exit 0 when all match, 1 otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

from patcher.proof.shards import write_shards

STEP_LINE = re.compile(r"^(step:\d+ train_loss:\S+|final val_loss:\S+|final val_bpb:\S+)$", re.M)


def run_script(path: str, data_dir: str, **env: str) -> list[str]:
    """Run a training script on CPU; returns its `step:N train_loss:X` and final lines."""
    full_env = dict(os.environ, DATA_PATH=data_dir, OMP_NUM_THREADS="1", **env)
    done = subprocess.run([sys.executable, path], env=full_env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{path} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return STEP_LINE.findall(done.stdout)


def main(argv: list[str] | None = None) -> int:
    original, patched = (argv or sys.argv[1:])[:2]
    with tempfile.TemporaryDirectory() as data_dir:
        write_shards(data_dir)
        reference = run_script(original, data_dir)
        ok = bool(reference)
        for toggle in ("1", "0"):
            lines = run_script(patched, data_dir, TRAIN_PREFETCH=toggle)
            same = lines == reference
            ok &= same
            print(f"TRAIN_PREFETCH={toggle}: {len(lines)} loss lines, {'bit-identical' if same else 'DIFFERENT'} to the original")
    print("demo:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

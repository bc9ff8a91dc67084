"""Prepare the inputs of `bench/gpu_proof.py` on a machine with network, before a GPU is started.

    python bench/gpu_prepare.py --root PATH --sdclip PATH --modded PATH --nanochat PATH [--out .gpu_inputs]
    python bench/gpu_prepare.py --fixtures [--out DIR]       # the bundled miniatures (the dry run)

Each script given is copied as `NAME_original.py` and patched with the default features
(`patch-prefetch ORIGINAL -o NAME_patched.py`) into `--out`, an ignored folder that
travels with the GPU run (`carry`). The real scripts are not part of this repository:
pass the copies you have at hand (parameter-golf's root `train_gpt.py`, an SDClip record
such as 2026-04-05's, modded-nanogpt's `train_gpt.py`, nanochat's `nanochat/dataloader.py`).
The GPU machine has no network, so the wheels it lacks (`WHEELS`, for CPython
`WHEEL_PYTHON` on x86-64) are downloaded into `--out/wheels`. `manifest.json` records
each script's source path and SHA-256, and the patcher that patched them (git commit,
whether the tree was dirty, and a SHA-256 over `patcher/` and `patcher/templates/`), so a result
names the code it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the GPU machine's image lacks of the patcher's dependencies.
WHEELS = ["libcst==1.9.0", "pyflakes==4.1.0", "python-minifier==3.4.0", "brotli==1.2.1"]
WHEEL_PYTHON = "3.12"
WHEEL_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
# The miniatures that stand in for each real script in a dry run.
FIXTURES = {
    "root": "tokenstream_readable.py",
    "sdclip": "shuffled_minified.py",
    "modded": "generator_shards.py",
    "nanochat": "bestfit_packing.py",
}


class PrepareError(Exception):
    """A script could not be patched, or a wheel could not be downloaded."""


def patcher_identity() -> dict:
    """The code that patches: {"commit", "dirty" (bool), "sha256"} where sha256 covers
    every `.py` file under `patcher/` and `patcher/templates/`, by path and content."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "patcher").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--", "patcher")), "sha256": digest.hexdigest()}


def prepare(out: Path, scripts: dict[str, Path] | None = None, fixtures: bool = False, wheels: bool = True) -> dict:
    """Copy and patch `scripts` ({name: path}; with `fixtures`, the bundled miniatures),
    download the wheels, write `out/manifest.json`. Returns the manifest.

    Raises PrepareError when a patch exits with anything but 0 (written) or 4 (written,
    its check failed: the check needs GPU-only modules a CPU lacks), or a download fails.
    """
    out.mkdir(parents=True, exist_ok=True)
    chosen = dict(scripts or {})
    if fixtures:
        chosen.update({name: ROOT / "fixtures" / file for name, file in FIXTURES.items() if name not in chosen})
    manifest = {"prepared": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "patcher": patcher_identity(), "fixtures": fixtures, "scripts": {}, "wheels": []}
    for name, source in chosen.items():
        source = Path(source)
        if not source.is_file():
            raise PrepareError(f"{source}: no such file")
        original, patched = out / f"{name}_original.py", out / f"{name}_patched.py"
        shutil.copyfile(source, original)
        done = subprocess.run([sys.executable, "-m", "patcher.cli", str(original), "-o", str(patched), "-q", "--no-import"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode not in (0, 4) or not patched.exists():
            raise PrepareError(f"{source}: patch-prefetch exited {done.returncode}: {done.stderr.strip()[-400:]}")
        manifest["scripts"][name] = {
            "source": str(source),
            "original": original.name,
            "patched": patched.name,
            "original_sha256": _sha256(original),
            "patched_sha256": _sha256(patched),
            "patch_exit": done.returncode,
        }
    if wheels:
        manifest["wheels"] = download_wheels(out / "wheels")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def download_wheels(folder: Path) -> list[str]:
    """Download `WHEELS` for the GPU machine's Python into `folder` (kept when already
    there). Returns the wheel file names. Raises PrepareError when pip fails."""
    folder.mkdir(parents=True, exist_ok=True)
    have = [p.name for p in folder.glob("*.whl")]
    wanted = [spec for spec in WHEELS if not any(_wheel_name(spec) in name.lower() for name in have)]
    if wanted:
        platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", WHEEL_PYTHON, "--implementation", "cp", *platforms, "-d", str(folder), *wanted]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise PrepareError(f"pip download failed: {done.stderr.strip()[-400:]}")
    return sorted(p.name for p in folder.glob("*.whl"))


def _wheel_name(spec: str) -> str:
    """The start of a wheel's file name for a requirement: `python-minifier==3.1.0` -> `python_minifier-3.1.0`."""
    name, _, version = spec.partition("==")
    return f"{name.replace('-', '_').lower()}-{version}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in FIXTURES:
        parser.add_argument(f"--{name}", type=Path, help=f"the real script for the '{name}' input")
    parser.add_argument("--fixtures", action="store_true", help="use the bundled miniatures for the inputs not given")
    parser.add_argument("--no-wheels", action="store_true", help="do not download the wheels")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu_inputs", help="output folder (default .gpu_inputs, ignored by git)")
    args = parser.parse_args(argv)
    scripts = {name: getattr(args, name) for name in FIXTURES if getattr(args, name)}
    if not scripts and not args.fixtures:
        parser.error("give at least one script (--root, --sdclip, --modded, --nanochat) or --fixtures")
    try:
        manifest = prepare(args.out, scripts, fixtures=args.fixtures, wheels=not args.no_wheels)
    except PrepareError as error:
        print(f"gpu_prepare: {error}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    for name, entry in manifest["scripts"].items():
        print(f"{name}: {entry['source']} -> {args.out / entry['patched']} (patch exit {entry['patch_exit']})")
    print(f"{len(manifest['wheels'])} wheels; {size / 2**20:.1f} MiB in {args.out}; patcher {manifest['patcher']['commit']} dirty={manifest['patcher']['dirty']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prepare the inputs of `bench/gpu_proof.py` on a machine with network, before a GPU is started.

    python bench/gpu_prepare.py --root PATH --sdclip PATH --nanochat-git DIR --modded-git DIR [--out .gpu_inputs]
    python bench/gpu_prepare.py --fixtures [--out DIR]       # the bundled miniatures (the dry run)

Each script given is copied as `NAME_original.py` and patched with the default features
(`patch-prefetch ORIGINAL -o NAME_patched.py`) into `--out`, an ignored folder that
travels with the GPU run (`carry`). The real scripts are not part of this repository:
pass the copies you have at hand (parameter-golf's root `train_gpt.py`, an SDClip record
such as 2026-04-05's, modded-nanogpt's `train_gpt.py`, nanochat's `nanochat/dataloader.py`).
The GPU machine has no network, so the wheels it lacks (`WHEELS`, for CPython
`WHEEL_PYTHON` on x86-64) are downloaded into `--out/wheels`. `manifest.json` records
each script's source path and SHA-256, and the patcher that patched them (git commit,
whether the tree was dirty, and a SHA-256 over `patcher/` and `templates/`), so a result
names the code it measured.

The end-to-end stages run nanochat's `scripts/base_train.py` and modded-nanogpt's
`train_gpt.py` whole, so they need the files those import from their own repositories:
`--nanochat-git DIR` and `--modded-git DIR` name a fetched snapshot (a git directory,
bare or not) from which `TREES` files of `--commit`-ish HEAD are copied into
`--out/nanochat_tree/` and `--out/modded_tree/` (with `git show`, nothing else of the
snapshot); the data loader (`nanochat/dataloader.py`) and the script (`train_gpt.py`)
become the `nanochat` and `modded` inputs unless `--nanochat` / `--modded` name others.
With `--fixtures`, `fixtures/nanochat_tree/` (our miniature) stands in. Everything
lands in one folder, the one path a device command carries (`MAX_CARRY_BYTES`).
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
# Files of each repository the end-to-end stages run beside the script (see `TREES`'s use).
TREES = {
    "nanochat": {
        "script": "nanochat/dataloader.py",
        "files": ["nanochat/__init__.py", "nanochat/checkpoint_manager.py", "nanochat/common.py", "nanochat/core_eval.py", "nanochat/dataset.py", "nanochat/engine.py", "nanochat/execution.py", "nanochat/flash_attention.py", "nanochat/fp8.py", "nanochat/gpt.py", "nanochat/loss_eval.py", "nanochat/optim.py", "scripts/base_train.py", "scripts/base_eval.py"],
    },
    "modded": {"script": "train_gpt.py", "files": ["triton_kernels.py", "dc_triton_kernels.py"]},
}
# What one device command carries: 64 MiB in at most 8 paths (the inputs are one of them).
MAX_CARRY_BYTES = 64 * 2**20
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
    every `.py` file under `patcher/` and `templates/`, by path and content."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "patcher").rglob("*.py"), *(ROOT / "templates").rglob("*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--", "patcher", "templates")), "sha256": digest.hexdigest()}


def copy_tree(name: str, git_dir: Path, out: Path, commit: str = "HEAD") -> tuple[dict, Path]:
    """Copy `TREES[name]`'s files at `commit` of the git directory `git_dir` into
    `out/NAME_tree/`, and its script into `out/_sources/`. Returns (the manifest's tree
    entry, the script's path). Raises PrepareError when git cannot show a file."""
    def show(path: str) -> bytes:
        done = subprocess.run(["git", "-C", str(git_dir), "show", f"{commit}:{path}"], capture_output=True)
        if done.returncode != 0:
            raise PrepareError(f"{git_dir}: git show {commit}:{path}: {done.stderr.decode(errors='replace').strip()[-300:]}")
        return done.stdout

    spec = TREES[name]
    tree = out / f"{name}_tree"
    shutil.rmtree(tree, ignore_errors=True)
    for path in spec["files"]:
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(show(path))
    script = out / "_sources" / f"{name}_{Path(spec['script']).name}"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_bytes(show(spec["script"]))
    resolved = subprocess.run(["git", "-C", str(git_dir), "rev-parse", commit], capture_output=True, text=True).stdout.strip()
    return {"dir": tree.name, "git": str(git_dir), "commit": resolved, "script": spec["script"], "files": spec["files"]}, script


def prepare(out: Path, scripts: dict[str, Path] | None = None, fixtures: bool = False, wheels: bool = True, gits: dict[str, Path] | None = None) -> dict:
    """Copy and patch `scripts` ({name: path}; with `fixtures`, the bundled miniatures),
    copy the end-to-end trees from `gits` ({"nanochat" or "modded": git directory}; with
    `fixtures`, the miniature nanochat tree), download the wheels, write
    `out/manifest.json`. Returns the manifest.

    Raises PrepareError when a patch exits with anything but 0 (written) or 4 (written,
    its check failed: the check needs GPU-only modules a CPU lacks), a git file cannot be
    shown, a download fails, or the folder outgrows `MAX_CARRY_BYTES`.
    """
    out.mkdir(parents=True, exist_ok=True)
    chosen = dict(scripts or {})
    trees = {}
    for name, git_dir in (gits or {}).items():
        trees[name], script = copy_tree(name, Path(git_dir), out)
        chosen.setdefault(name, script)
    if fixtures:
        chosen.update({name: ROOT / "fixtures" / file for name, file in FIXTURES.items() if name not in chosen})
        if "nanochat" not in trees:
            tree = out / "nanochat_tree"
            shutil.rmtree(tree, ignore_errors=True)
            shutil.copytree(ROOT / "fixtures" / "nanochat_tree", tree, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
            trees["nanochat"] = {"dir": tree.name, "git": None, "commit": None, "script": FIXTURES["nanochat"], "files": sorted(str(p.relative_to(tree)) for p in tree.rglob("*.py"))}
        if "modded" not in trees:  # the miniature needs nothing beside it
            (out / "modded_tree").mkdir(exist_ok=True)
            trees["modded"] = {"dir": "modded_tree", "git": None, "commit": None, "script": FIXTURES["modded"], "files": []}
    manifest = {"prepared": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "patcher": patcher_identity(), "fixtures": fixtures, "scripts": {}, "trees": trees, "wheels": []}
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
    manifest["bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if manifest["bytes"] > MAX_CARRY_BYTES:
        raise PrepareError(f"{out}: {manifest['bytes'] / 2**20:.1f} MiB, over the {MAX_CARRY_BYTES / 2**20:.0f} MiB a device command carries")
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
    for name in TREES:
        parser.add_argument(f"--{name}-git", type=Path, help=f"a fetched snapshot (git directory) of {name}: its end-to-end tree and, unless --{name} is given, its '{name}' input")
    parser.add_argument("--fixtures", action="store_true", help="use the bundled miniatures for the inputs not given")
    parser.add_argument("--no-wheels", action="store_true", help="do not download the wheels")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu_inputs", help="output folder (default .gpu_inputs, ignored by git)")
    args = parser.parse_args(argv)
    scripts = {name: getattr(args, name) for name in FIXTURES if getattr(args, name)}
    gits = {name: getattr(args, f"{name}_git") for name in TREES if getattr(args, f"{name}_git")}
    if not scripts and not gits and not args.fixtures:
        parser.error("give at least one script (--root, --sdclip, --modded, --nanochat, --nanochat-git, --modded-git) or --fixtures")
    try:
        manifest = prepare(args.out, scripts, fixtures=args.fixtures, wheels=not args.no_wheels, gits=gits)
    except PrepareError as error:
        print(f"gpu_prepare: {error}", file=sys.stderr)
        return 2
    for name, entry in manifest["scripts"].items():
        print(f"{name}: {entry['source']} -> {args.out / entry['patched']} (patch exit {entry['patch_exit']})")
    for name, tree in manifest["trees"].items():
        size = sum(p.stat().st_size for p in (args.out / tree["dir"]).rglob("*") if p.is_file())
        print(f"{name} tree: {len(tree['files'])} files, {size / 1024:.0f} KiB, from {tree['git'] or 'fixtures'} at {tree['commit'] or '-'}")
    wheel_bytes = sum(p.stat().st_size for p in (args.out / "wheels").glob("*.whl")) if (args.out / "wheels").exists() else 0
    print(f"{len(manifest['wheels'])} wheels, {wheel_bytes / 2**20:.1f} MiB; {manifest['bytes'] / 2**20:.1f} MiB in {args.out} (one carried path of at most {MAX_CARRY_BYTES / 2**20:.0f} MiB); patcher {manifest['patcher']['commit']} dirty={manifest['patcher']['dirty']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

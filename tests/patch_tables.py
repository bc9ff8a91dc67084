"""`assert_patch` and `assert_noop`: the helpers of the before -> after and noop tables.

A table row compares a whole output, not a substring of it, so a stray edit anywhere
in the script fails the row. The injected runtime block (templates, tested on their
own in test_templates.py and by the end-to-end runs) stands in the expected text as
the one line `RUNTIME`. A noop row also names the reason the report gives for the
skip, exactly, with its line.
"""

from __future__ import annotations

from patcher.patch import PatchResult, features_from, patch_source
from patcher.transforms.base import Note
from patcher.transforms.features import FEATURES

# A tiny script with one rewrite (the MLP square), patched in milliseconds.
TINY = (
    "import torch\n"
    "\n"
    "\n"
    "class MLP(torch.nn.Module):\n"
    "    def forward(self, x):\n"
    "        return self.proj(torch.relu(self.fc(x)).square())\n"
)

RUNTIME = "#<runtime>\n"


def shown(result: PatchResult) -> str:
    """The patched source with its runtime block replaced by the line `RUNTIME`."""
    if not result.runtime:
        return result.source
    assert result.source.count(result.runtime) == 1
    return result.source.replace(result.runtime, RUNTIME)


def assert_patch(before: str, after: str | None = None, only: str | list[str] | None = None, enabled: set[str] | None = None) -> PatchResult:
    """Patch `before` and assert the whole output.

    only: a feature (or list) applied alone, with env_toggles where it reads a toggle,
    as `--only` does; enabled: the exact feature set instead; neither: the default
    features. after: the expected output (runtime block as `RUNTIME`); None for a noop
    row: the output must equal the input and no feature may apply. Returns the result.
    """
    if enabled is None and only is not None:
        enabled = features_from([only] if isinstance(only, str) else list(only), None)
    result = patch_source(before, enabled)
    if after is None:
        assert result.source == before, "a noop row changed the script"
        assert not result.applied
    else:
        assert shown(result) == after
    return result


def assert_refused_beside_others(source: str, feature: str) -> None:
    """With every feature on, `feature` refuses `source`: the output is that of every
    feature but `feature` (a noop row checked beside the others)."""
    others = set(FEATURES) - {feature}
    assert patch_source(source, set(FEATURES)).source == patch_source(source, others).source


def notes_of(result: PatchResult, feature: str) -> list[tuple[bool, str | None, int | None]]:
    """`feature`'s report lines in `result`, in order: (applied, reason, line) each."""
    return [(n.applied, n.reason, n.line) for n in result.notes if n.feature == feature]


def assert_noop(before: str, reason: str, line: int | None = None, only: str | list[str] | None = None, enabled: set[str] | None = None, feature: str | None = None, unfixable: bool = False) -> PatchResult:
    """A noop row: patching `before` changes nothing, applies nothing, and `feature` says why.

    only / enabled: as for `assert_patch`. feature: whose report line is checked
    (default: `only` when it names one feature). The feature must give exactly one
    note: skipped, with exactly `reason` and `line` (None: a note with no line), and
    `unfixable` as given. Returns the result.
    """
    feature = feature if feature is not None else only if isinstance(only, str) else None
    assert feature is not None, "name the feature whose reason the row checks"
    result = assert_patch(before, None, only=only, enabled=enabled)
    assert [n for n in result.notes if n.feature == feature] == [Note(feature, False, reason, line, unfixable)]
    return result

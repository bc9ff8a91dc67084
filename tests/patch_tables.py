"""`assert_patch`: the one helper of the before -> after and noop tables.

A table row compares a whole output, not a substring of it, so a stray edit anywhere
in the script fails the row. The injected runtime block (templates, tested on their
own in test_templates.py and by the end-to-end runs) stands in the expected text as
the one line `RUNTIME`.
"""

from __future__ import annotations

from patcher.patch import PatchResult, features_from, patch_source
from patcher.transforms.features import FEATURES

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


def assert_noop_reason(before: str, reason: str, only: str, line: int | None = None) -> PatchResult:
    """A noop row with its reason: `only` applied alone (as in `assert_patch`) leaves
    `before` byte-identical, and its report is the one skip note `reason`, exactly (at
    `line` too, when given). Returns the result."""
    result = assert_patch(before, None, only=only)
    notes = [n for n in result.notes if n.feature == only]
    assert [n.reason for n in notes] == [reason]
    if line is not None:
        assert notes[0].line == line
    return result

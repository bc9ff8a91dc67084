"""Counted code bytes (wrapper, minified, raw) and the artifact budget from submission.json."""

from __future__ import annotations

import base64
import json
import lzma
import shutil
from pathlib import Path

import libcst as cst
import pytest
import python_minifier

from patcher.cli import main
from patcher.code_size import ARTIFACT_CAP, Counting, count_patch, counting_of, minified_wrapper_bytes, read_artifact_bytes
from patcher.patch import patch_source
from patcher.read.source import read_script
from patcher.transforms.features import DEFAULT_FEATURES

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

SIZE_FUNCTION = '''
import lzma, base64, subprocess
def _code_size(code):
    minified = subprocess.run(["pyminify", "--no-rename-locals", "--remove-literal-statements", "-"], input=code, capture_output=True).stdout
    return len(base64.b85encode(lzma.compress(minified)))
'''


BROTLI_SIZE_FUNCTION = '''
import brotli as BR, shutil, subprocess
def _compressed_code_size(code):
    exe = shutil.which("pyminify")
    minified = subprocess.run([exe, "--no-rename-locals", "-"], input=code, capture_output=True).stdout
    return len(BR.compress(minified, quality=11))
'''


def test_counting_of_a_brotli_record():
    assert counting_of(cst.parse_module(BROTLI_SIZE_FUNCTION), False) == Counting("minified", ("--no-rename-locals",), "brotli")
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    import brotli

    minified = python_minifier.minify(source, rename_locals=False)
    wrapper = b'import brotli as B,base64 as A\nexec(B.decompress(A.b85decode("' + base64.b85encode(brotli.compress(minified.encode(), quality=11)) + b'")))\n'
    assert minified_wrapper_bytes(source, ("--no-rename-locals",), "brotli") == len(wrapper)


def test_a_companion_of_the_submitted_script_has_no_budget(tmp_path):
    (tmp_path / "submission.json").write_text(json.dumps({"bytes_total": 15_000_000}))
    (tmp_path / "train_gpt.py").write_text("x = 1\n")
    assert read_artifact_bytes(tmp_path / "train_gpt_human.py") is None
    assert read_artifact_bytes(tmp_path / "train_gpt.py") == 15_000_000


@pytest.mark.parametrize(
    "source, wrapped, how, flags",
    [
        pytest.param("x = 1\n", True, "wrapper", (), id="a-wrapper-counts-its-file"),
        pytest.param(SIZE_FUNCTION, False, "minified", ("--no-rename-locals", "--remove-literal-statements"), id="the-scripts-own-pyminify-flags"),
        pytest.param("cmd = ['python', 'pyminify']\n", False, "raw", (), id="pyminify-not-first-is-not-a-command"),
        pytest.param("x = 1\n", False, "raw", (), id="plain-counts-raw"),
    ],
)
def test_counting_of(source, wrapped, how, flags):
    assert counting_of(cst.parse_module(source), wrapped) == Counting(how, flags)


def test_minified_count_is_the_records_own_computation():
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    minified = python_minifier.minify(source, rename_locals=False, hoist_literals=False, remove_literal_statements=True)
    encoded = base64.b85encode(lzma.compress(minified.encode()))
    wrapper = b'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("' + encoded + b'")))\n'
    assert minified_wrapper_bytes(source) == len(wrapper)
    # Docstrings do not count with --remove-literal-statements; code does.
    documented = source.replace("def main() -> None:", "def main() -> None:\n    \"\"\"A long docstring that the minifier removes entirely.\"\"\"", 1)
    assert documented != source and minified_wrapper_bytes(documented) == len(wrapper)
    assert minified_wrapper_bytes(source + "\nextra_name_that_counts = 12345\n") > len(wrapper)


@pytest.mark.parametrize(
    "data, want",
    [
        pytest.param({"seed_results": {"1": {"artifact_bytes": 15_990_000}, "2": {"artifact_bytes": 15_995_500}}}, 15_995_500, id="largest-seed"),
        pytest.param({"bytes_total": 15_800_000, "bytes_code": 50_000}, 15_800_000, id="a-total"),
        pytest.param({"seeds": {"0": {"bytes_total": 15_900_001}}, "artifact_bytes_mean": 1}, 15_900_001, id="nested-totals-not-the-mean"),
        pytest.param({"val_bpb": 1.07}, None, id="no-size"),
    ],
)
def test_read_artifact_bytes(tmp_path, data, want):
    (tmp_path / "submission.json").write_text(json.dumps(data))
    assert read_artifact_bytes(tmp_path / "train_gpt.py") == want


def test_read_artifact_bytes_without_a_readable_file(tmp_path):
    assert read_artifact_bytes(tmp_path / "train_gpt.py") is None
    (tmp_path / "submission.json").write_text("{not json")
    assert read_artifact_bytes(tmp_path / "train_gpt.py") is None


def _record(tmp_path, artifact_bytes):
    shutil.copy(FIXTURES / "tokenstream_readable.py", tmp_path / "train_gpt.py")
    (tmp_path / "submission.json").write_text(json.dumps({"seed_results": {"42": {"artifact_bytes": artifact_bytes}}}))
    return tmp_path / "train_gpt.py"


def test_report_counts_bytes_per_feature_and_fits_the_cap(tmp_path, capsys):
    script = _record(tmp_path, 15_000_000)
    assert main([str(script), "-o", str(tmp_path / "out.py"), "--no-check", "--json", "--byte-breakdown"]) == 0
    report = json.loads(capsys.readouterr().out)
    counted = report["code_bytes"]
    raw = (tmp_path / "out.py").read_bytes()
    assert counted["counted_as"] == "raw" and counted["after"] == len(raw) and counted["before"] == len(script.read_bytes())
    assert set(counted["by_feature"]) == set(report["applied"]) == set(counted["by_feature_raw"])
    assert sum(counted["by_feature"].values()) + counted["shared"] == counted["after"] - counted["before"]
    # the default counts the same before and after, without the per-feature patches
    assert main([str(script), "-o", str(tmp_path / "plain.py"), "--no-check", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["code_bytes"]
    assert plain == dict(counted, by_feature={}, by_feature_raw={}, shared=0)
    assert report["artifact"] == {"cap": ARTIFACT_CAP, "before": 15_000_000, "after": 15_000_000 + counted["after"] - counted["before"], "over": 0}


def test_over_the_cap_one_line_and_one_cost_per_feature_what_its_skip_saves(tmp_path, capsys):
    """Over the cap: exit 4, one line, the output written. `--byte-breakdown` and the
    over-the-cap line give each feature the same cost: the whole patch's count minus the
    count of the patch without it; the breakdown's lines add up to the total."""
    from patcher.code_size import cost_lines

    script = _record(tmp_path, ARTIFACT_CAP - 100)
    code = main([str(script), "-o", str(tmp_path / "out.py"), "--no-check", "--byte-breakdown"])
    out, err = capsys.readouterr()
    assert code == 4
    line = err.strip()
    assert "\n" not in line and str(script) in line and "over the 16000000-byte cap" in line and "train_prefetch +" in line
    assert "artifact (submission.json, largest)" in out and "over the cap" in out
    assert (tmp_path / "out.py").exists()  # written; the check failed
    said = {name: int(cost) for name, cost in (part.rsplit(" ", 1) for part in line.split("--skip would save it: ")[1].split(")")[0].split(", "))}
    shown = {name: int(cost) for name, cost in (x.split()[:2] for x in out.split("code bytes, ")[1].splitlines()[1:] if x.startswith("    "))}
    total = len((tmp_path / "out.py").read_bytes())
    source = read_script(script).source
    assert set(said) == {"train_prefetch", "copy_stream", "mlp_fusion", "val_prefetch", "env_toggles"}
    assert all(shown[feature] == cost > 0 for feature, cost in said.items())
    # copy_stream: once charged -34 here (its share after train_prefetch), +390 in the over-cap line
    without = patch_source(source, set(DEFAULT_FEATURES) - {"copy_stream"}).source
    assert said["copy_stream"] == total - len(without.encode())
    assert sum(shown.values()) == total - len(script.read_bytes())
    assert cost_lines({"counted": "raw", "by_feature": said, "shared": 0}) == [f"{n:15} {c:+d}" for n, c in said.items()]


def test_cost_lines_explain_a_negative_cost():
    from patcher.code_size import cost_lines

    lines = cost_lines({"counted": "counted as minified", "by_feature": {"a": -3, "b": -5, "c": 7}, "by_feature_raw": {"a": 40, "b": -9, "c": 7}, "shared": 2})
    assert "it adds +40 raw bytes" in lines[0] and "cut to the options chosen" in lines[1] and "(" not in lines[2]
    assert lines[3].split()[:2] == ["shared", "+2"]


@pytest.mark.parametrize(
    "fixture, noted",
    [
        pytest.param("tokenstream_readable.py", True, id="parameter-golf-tokenstream"),
        pytest.param("generator_shards.py", False, id="modded-nanogpt-no-prefetch"),
        pytest.param("bestfit_packing.py", False, id="nanochat"),
    ],
)
def test_the_cap_note_only_for_parameter_golf_scripts(tmp_path, capsys, fixture, noted):
    script = tmp_path / "train_gpt.py"
    shutil.copy(FIXTURES / fixture, script)
    assert main([str(script), "-o", str(tmp_path / "out.py"), "--no-check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["applied"] and report["code_bytes"]["after"] > report["code_bytes"]["before"]
    assert (report["cap_note"] is not None) == noted
    # the switches the report names are those the output reads, no other
    written = (tmp_path / "out.py").read_text()
    assert report["switches"] and all(f'"{name}"' in written for name in report["switches"])
    assert ("TRAIN_PREFETCH" in report["switches"]) == ('"TRAIN_PREFETCH"' in written) == ("train_prefetch" in report["applied"])
    if fixture == "generator_shards.py":  # a parameter-golf record's folder says it is one, whatever its loader
        record = tmp_path / "track_10min_16mb" / "2026-04-01_x"
        record.mkdir(parents=True)
        shutil.copy(script, record / "train_gpt.py")
        assert main([str(record / "train_gpt.py"), "-o", str(tmp_path / "out2.py"), "--no-check", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["cap_note"] is not None


@pytest.mark.parametrize(
    "fixture, args, how, label",
    [
        pytest.param("tokenstream_readable.py", [], "raw", "raw: the UTF-8 bytes of the code", id="raw"),
        pytest.param("wrapped_lzma_raw.py", [], "wrapper", "counted as wrapper: the bytes of the wrapped file", id="wrapper"),
        pytest.param("wrapped_lzma_raw.py", ["--no-rewrap"], "raw", "raw: the UTF-8 bytes of the code", id="no-rewrap"),
    ],
)
def test_code_bytes_say_what_is_counted_alike_in_text_and_json(tmp_path, capsys, fixture, args, how, label):
    script = FIXTURES / fixture
    assert main([str(script), "-o", str(tmp_path / "j.py"), "--no-check", "--json", *args]) == 0
    counted = json.loads(capsys.readouterr().out)["code_bytes"]
    assert (counted["counted_as"], counted["counted"]) == (how, label)
    if how == "raw":  # what was written is plain code: its bytes, and the input's code before
        assert counted["after"] == len((tmp_path / "j.py").read_bytes())
        assert counted["before"] == len(read_script(script).source.encode("utf-8"))
    assert main([str(script), "-o", str(tmp_path / "t.py"), "--no-check", *args]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if "code bytes" in x]
    assert line.strip() == f"code bytes, {label}: {counted['before']} -> {counted['after']} ({counted['after'] - counted['before']:+d})"


def test_a_minified_count_started_before_the_patch_equals_one_made_after(tmp_path):
    source = SIZE_FUNCTION + (FIXTURES / "tokenstream_readable.py").read_text()
    path = tmp_path / "train_gpt.py"
    path.write_text(source)
    script = read_script(path)
    counting = counting_of(script.module, False)
    assert counting.how == "minified"
    before = counting.start(script.raw, script.source)  # under way while the patch runs
    result = patch_source(script.source, module=script.module)
    early = count_patch(script, result, set(DEFAULT_FEATURES), counting, breakdown=False, before=before)
    late = count_patch(script, result, set(DEFAULT_FEATURES), counting, breakdown=False)
    assert early == late and early["before"] == minified_wrapper_bytes(source, counting.minify_flags)
    assert early["after"] == minified_wrapper_bytes(result.source, counting.minify_flags) > early["before"]

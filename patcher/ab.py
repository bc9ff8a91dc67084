"""`patch-prefetch ab ORIGINAL PATCHED`: A/B step time of two training scripts, on your GPU.

Runs the two scripts alternately (A B A B ...), each run its own process (`python
SCRIPT`, or `python -m torch.distributed.run --standalone --nproc_per_node K SCRIPT`,
which is `torchrun`), stops each run as soon as it has logged step S (SIGKILL of its
process group: no run pays for final evaluation or quantisation), reads the step time
from the script's own log lines, and compares the two sides: the patched/original
(B/A) ratio of the step time with a 95 % confidence interval and a p-value (Welch, on
the log of each run's step time, so the interval of the ratio is never negative), the
smallest difference the runs could detect, and a verdict in words.

A measurement must not change what it measures: a run logs a line every `log_every`
steps (`TRAIN_LOG_EVERY`, 20 by default), not every step. A parameter-golf log line
calls `train_loss.item()`, a host-device sync that the user's run (a line every 200
steps) makes that rarely too; one sync in 20 steps costs the run-ahead of one step in
20. A run's step time is the median, over the windows between two log lines after the
first `skip` steps, of the change of the script's own cumulative training time per step
(`train_time`); its within-run spread is those windows' spread. Both sides share one
compile cache (inductor's and triton's, unless set), so only the first run compiles;
the time to a run's first step line is reported apart from its step time.

Pieces, each small: `LOG_FORMATS` (one parser per log format, tried in turn),
`run_env` / `run_command` (what a run is given), `run_once` (one process, stopped at
step S), `step_ms` (a run's mean step time from its points), `compare` (the
statistics), `verdict` and `format_report` (the words), `run_ab` (all of it).

What each known script reads, taken from the public repositories:

- parameter-golf (root `train_gpt.py` and the records): `ITERATIONS` (steps),
  `TRAIN_LOG_EVERY` (1: a line every step), `VAL_LOSS_EVERY` (0: no validation
  mid-run), `TRAIN_BATCH_TOKENS` (tokens a step; what a 2026-04 record's `tok/s`
  is divided into);
- modded-nanogpt `train_gpt.py`: no setting (its step count is the hard-coded
  `num_scheduled_iterations + num_extension_iterations`): stopping at step S bounds it;
  it reads `RANK`/`WORLD_SIZE`/`LOCAL_RANK`, so run it with `--nproc-per-node`;
- nanochat `scripts/base_train.py`: the command-line flag `--num-iterations`, which
  is passed when the script's source defines it (a flag given after `--` wins).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

DEFAULT_RUNS = 5
DEFAULT_STEPS = 200
DEFAULT_LOG_EVERY = 20  # steps between two log lines (and syncs) of a run: a window
DEFAULT_UNTIL_RUNS = 20  # with --until: the most runs a side
NOISY_PCT = 5.0  # runs that cannot see a difference this large (%) say nothing about a ~1 % gain
OUTLIER_MADS = 3.5  # a run this many scaled MADs from its side's median level or spread is flagged
DEFAULT_TIMEOUT_S = 900.0
ALPHA = 0.05  # a difference is claimed when the 95 % CI excludes 0 and p < ALPHA
TAIL_LINES = 20  # lines of stderr (and stdout) kept per run for an error report
SHOWN_TAIL = 5  # of them, in the one-line error
# A producer that could not run says so in one line on stderr (templates/prefetch_lean.py,
# its forked and its spawned start); every line starting with "prefetch:" is quoted.
FALLBACK_MARKERS = ("runs without prefetch", "runs in the training process")
PREFETCH_PREFIX = "prefetch:"
# torchrun's `--tee`/`--log-line-prefix-template` put `[default0]:` before a rank's lines.
_RANK_PREFIX = re.compile(r"^\[[^\]\s]*\]:\s?")


class AbError(Exception):
    """Bad input, bad usage, or a failed run: the message is one line; exit code 2."""


@dataclass(frozen=True)
class LogFormat:
    """One log format: `pattern` matched at the start of a line, its group `step`
    the step number printed, and one of the groups below for the time.

    kind: "cumulative" (group `ms`: training time since the start, ms; or group
    `toks`: cumulative tokens/s, turned into ms with the tokens a step), "per_step"
    (group `ms`: that step's time) or "arrival" (no time in the line: the time the
    line reached us). step_offset: completed steps = printed step + step_offset.
    """

    name: str
    example: str
    pattern: re.Pattern
    kind: str
    step_offset: int = 0

    def parse(self, line: str, tokens_per_step: Optional[int]) -> Optional[tuple[int, Optional[float]]]:
        """(completed steps, ms or None) of `line`, or None when it is not this format's
        step line. The ms is cumulative or per step as `kind` says; None for "arrival",
        and for a tok/s line without `tokens_per_step`."""
        found = self.pattern.match(line)
        if found is None:
            return None
        steps = int(found.group("step")) + self.step_offset
        groups = found.groupdict()
        if groups.get("ms") is not None:
            return steps, float(groups["ms"])
        if groups.get("toks") is not None:
            toks = float(groups["toks"])
            if not tokens_per_step or toks <= 0:
                return steps, None
            return steps, steps * tokens_per_step * 1000.0 / toks
        return steps, None

    @property
    def needs_tokens(self) -> bool:
        return "toks" in self.pattern.groupindex


# Tried in turn; a run's format is the first one with a line in its output.
LOG_FORMATS: tuple[LogFormat, ...] = (
    LogFormat(
        "parameter-golf",
        "step:N/M train_loss:X train_time:Tms step_avg:Ams",
        re.compile(r"step:(?P<step>\d+)/\d+ train_loss:\S+ train_time:(?P<ms>[\d.]+)ms step_avg:[\d.]+ms"),
        "cumulative",
    ),
    LogFormat(
        "parameter-golf 2026-04 records",
        "N/M train_loss: X train_time: Ym tok/s: T",
        re.compile(r"(?P<step>\d+)/\d+ train_loss: \S+ train_time: \S+ tok/s: (?P<toks>[\d.]+)"),
        "cumulative",
    ),
    LogFormat(
        "modded-nanogpt",
        "step:N/M train_time:Tms step_avg:Ams",
        re.compile(r"step:(?P<step>\d+)/\d+ train_time:(?P<ms>[\d.]+)ms step_avg:[\d.]+ms"),
        "cumulative",
    ),
    LogFormat(
        "nanochat base_train",
        "step 00010/00050 (...) | ... | dt: 123.45ms | ...",
        re.compile(r"step (?P<step>\d+)/\d+ \(.*?\) \|.*\| dt: (?P<ms>[\d.]+)ms\b"),
        "per_step",
        step_offset=1,  # it prints the step's index before counting it
    ),
    LogFormat(
        "step lines timed on arrival",
        "step:N train_loss:X (no time in the line)",
        re.compile(r"step[: ](?P<step>\d+)(?:/\d+)? train_loss[: ]"),
        "arrival",
    ),
)


def custom_format(regex: str) -> LogFormat:
    """The `--step-regex` format: `regex`'s first group (or group `step`) is the number of
    steps done; a group `ms` (cumulative training time, ms) is used where present, else
    the lines are timed on arrival. Raises AbError for a regex that does not compile or
    has no group."""
    try:
        pattern = re.compile(regex)
    except re.error as error:
        raise AbError(f"--step-regex {regex!r}: not a regular expression: {error}") from None
    if pattern.groups == 0:
        raise AbError(f"--step-regex {regex!r}: needs a group for the step number, e.g. 'iter (\\d+)'")
    if "step" not in pattern.groupindex:
        # name the first group `step` without changing what the regex matches
        pattern = re.compile(re.sub(r"\((?!\?)", "(?P<step>", regex, count=1))
    kind = "cumulative" if "ms" in pattern.groupindex else "arrival"
    return LogFormat(f"--step-regex {regex}", regex, pattern, kind)


@dataclass
class RunResult:
    """One run. step_ms: its mean step time in ms (None until measured); points: the
    completed steps and ms (cumulative, per step, or arrival ms since start) of the
    chosen format's lines."""

    index: int
    side: str  # "a" or "b"
    label: str
    script: str
    returncode: Optional[int] = None
    stopped_at_steps: bool = False
    timed_out: bool = False
    steps_reached: int = 0
    format: Optional[str] = None
    points: list = field(default_factory=list)
    step_ms: Optional[float] = None
    steps_measured: int = 0
    windows: list = field(default_factory=list)  # ms a step in each window after skip
    spread_pct: Optional[float] = None  # within-run: sd of the windows, % of step_ms
    first_step_s: Optional[float] = None  # seconds to the first step line (compile, start-up)
    outlier: Optional[str] = None  # why this run stands apart from its side's
    prefetch_lines: list = field(default_factory=list)
    fell_back: bool = False
    wall_s: float = 0.0
    stderr_tail: list = field(default_factory=list)
    stdout_tail: list = field(default_factory=list)
    error: Optional[str] = None

    def as_dict(self) -> dict:
        return {
            "index": self.index, "side": self.side, "label": self.label, "script": self.script,
            "step_ms": None if self.step_ms is None else round(self.step_ms, 4),
            "steps_reached": self.steps_reached, "steps_measured": self.steps_measured, "format": self.format,
            "windows": len(self.windows), "spread_pct": _round(self.spread_pct, 3),
            "first_step_s": _round(self.first_step_s, 2), "outlier": self.outlier,
            "stopped_at_steps": self.stopped_at_steps, "returncode": self.returncode, "timed_out": self.timed_out,
            "wall_s": round(self.wall_s, 2), "prefetch_lines": self.prefetch_lines, "fell_back": self.fell_back,
        }


def step_env(steps: int, log_every: int = DEFAULT_LOG_EVERY) -> dict[str, str]:
    """What bounds a run to `steps` and makes it log a line every `log_every` steps (a
    sync each in parameter-golf: never every step), for the scripts that read it from
    the environment (parameter-golf; see the module docstring)."""
    return {"ITERATIONS": str(steps), "TRAIN_LOG_EVERY": str(log_every), "VAL_LOSS_EVERY": "0", "PYTHONUNBUFFERED": "1"}


def parse_assignments(items: list[str], option: str) -> dict[str, str]:
    """`NAME=VALUE` strings as a dict. Raises AbError naming `option` for one without
    `=` or with an empty name."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or "\0" in item:
            raise AbError(f"{option} {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def run_env(steps: int, env: dict[str, str], env_b: dict[str, str], side: str, base: Optional[dict] = None,
            log_every: int = DEFAULT_LOG_EVERY) -> dict[str, str]:
    """The environment of one run: `base` (default os.environ), then `step_env(steps,
    log_every)`, then `env` (both sides), then `env_b` (side "b" only): a name given
    with --env wins."""
    out = dict(os.environ if base is None else base)
    out.update(step_env(steps, log_every))
    out.update(env)
    if side == "b":
        out.update(env_b)
    return out


def step_args(script: Path, steps: int, script_args: list[str]) -> list[str]:
    """Command-line arguments that bound `script` to `steps`: nanochat's
    `--num-iterations=S` when the script's source defines that flag and `script_args`
    does not give it; else none."""
    if any(a == "--num-iterations" or a.startswith("--num-iterations=") for a in script_args):
        return []
    try:
        source = script.read_bytes()
    except OSError:
        return []
    return [f"--num-iterations={steps}"] if b'"--num-iterations"' in source or b"'--num-iterations'" in source else []


def run_command(script: Path, nproc_per_node: Optional[int], args: list[str], python: Optional[str] = None) -> list[str]:
    """The command of one run: `python SCRIPT ARGS`, or, with `nproc_per_node` K,
    torchrun's `--standalone --nproc_per_node K SCRIPT ARGS` through that Python
    (`python -m torch.distributed.run`, what the `torchrun` command runs). `python`:
    the interpreter of the training environment (default: the one running this)."""
    python = python or sys.executable
    if nproc_per_node is None:
        return [python, str(script), *args]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}", str(script), *args]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` (the script and whatever it forked)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_once(
    result: RunResult,
    command: list[str],
    env: dict[str, str],
    cwd: str,
    steps: int,
    timeout_s: float,
    formats: tuple[LogFormat, ...],
    tokens_per_step: Optional[int],
) -> RunResult:
    """Run `command` in its own session until a line of one of `formats` says `steps`
    steps are done, then SIGKILL its process group (so nothing after step S runs); or
    until it exits, or `timeout_s` seconds pass (then killed, `timed_out`).

    Both stdout and stderr are read, each on a thread that parses every line as it
    arrives and kills the group itself on the stop line (it reads nothing after it).
    Fills `result`: returncode (None when we stopped it), stopped_at_steps,
    steps_reached, format (the first of `formats` that matched a line), points,
    prefetch_lines, fell_back, the tails, wall_s. On Ctrl-C the group is killed first
    and KeyboardInterrupt re-raised. Raises AbError when the command cannot start.
    """
    lock = threading.Lock()
    seen: dict[int, list] = {}  # format index -> [(steps, ms or None, arrival ms)]
    tails = {"stdout": deque(maxlen=TAIL_LINES), "stderr": deque(maxlen=TAIL_LINES)}
    state = {"stop": False, "tokens_missing": None}
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as error:
        raise AbError(f"{command[0]}: cannot start run {result.index} ({result.label}): {error.strerror or error}") from None

    def read(stream, name: str) -> None:
        for raw in iter(stream.readline, b""):
            arrived = 1000.0 * (time.perf_counter() - start)
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            text = _RANK_PREFIX.sub("", line, count=1)
            with lock:
                tails[name].append(line)
                if text.startswith(PREFETCH_PREFIX) or any(m in text for m in FALLBACK_MARKERS):
                    result.prefetch_lines.append(text)
                for i, fmt in enumerate(formats):
                    parsed = fmt.parse(text, tokens_per_step)
                    if parsed is None:
                        continue
                    if fmt.needs_tokens and parsed[1] is None and not any(seen.get(j) for j in range(i)):
                        state["tokens_missing"] = fmt
                        state["stop"] = True
                    seen.setdefault(i, []).append((parsed[0], parsed[1], arrived))
                    if parsed[0] >= steps:
                        state["stop"] = True
                    break
                stop = state["stop"]
            if stop:
                _kill_group(proc)
                return

    readers = [threading.Thread(target=read, args=(s, n), daemon=True) for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for reader in readers:
        reader.start()
    try:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            result.timed_out = True
            _kill_group(proc)
            proc.wait()
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        for reader in readers:
            reader.join(timeout=5.0)  # a descendant that left the group may hold a pipe
        proc.stdout.close()
        proc.stderr.close()
    result.wall_s = time.perf_counter() - start
    with lock:
        result.stopped_at_steps = state["stop"] and state["tokens_missing"] is None
        result.returncode = None if result.stopped_at_steps else proc.returncode
        result.stderr_tail, result.stdout_tail = list(tails["stderr"]), list(tails["stdout"])
        result.fell_back = any(m in line for line in result.prefetch_lines for m in FALLBACK_MARKERS)
        first = min(seen) if seen else None
        if first is not None:
            fmt = formats[first]
            result.format = fmt.name
            result.points = [(s, a if fmt.kind == "arrival" else ms) for s, ms, a in seen[first]]
            result.steps_reached = max(s for s, _, _ in seen[first])
            result.first_step_s = min(a for _, _, a in seen[first]) / 1000.0
        if state["tokens_missing"] is not None:
            result.error = (
                f"its log is {state['tokens_missing'].name}'s ({state['tokens_missing'].example}): a step time needs the "
                "tokens a step; give TRAIN_BATCH_TOKENS with --env or --tokens-per-step"
            )
    return result


def default_skip(steps: int) -> int:
    """Steps left out at the start of each run by default: 20 % of `steps`, at least 1."""
    return max(1, round(0.2 * steps))


def windows(points: list[tuple[int, float]], kind: str, skip: int) -> tuple[list[float], int]:
    """The ms a step of each window after the first `skip` steps, and the steps they cover.

    points: (completed steps, ms) in log order. For kind "cumulative" and "arrival" the
    ms is a running clock (training time, or arrival time): a window runs from one point
    to the next, starting at the last point at or before step `skip` (the first point
    after it when none is), and its figure is the clock's change over its steps. For
    "per_step" each point after step `skip` is a window of one step.
    """
    points = sorted((s, ms) for s, ms in points if ms is not None)
    if kind == "per_step":
        kept = [ms for s, ms in points if s > skip]
        return kept, len(kept)
    before = [p for p in points if p[0] <= skip]
    start = points.index(before[-1]) if before else 0
    out, covered = [], 0
    for (s0, t0), (s1, t1) in zip(points[start:], points[start + 1:]):
        if s1 > s0:
            out.append((t1 - t0) / (s1 - s0))
            covered += s1 - s0
    return out, covered


def step_ms(points: list[tuple[int, float]], kind: str, skip: int) -> tuple[Optional[float], int]:
    """A run's step time in ms: the median of its `windows` after the first `skip`
    steps (a window slowed by a shard load or a checkpoint moves it little), and how
    many steps the windows cover. (None, 0) where no window qualifies."""
    found, covered = windows(points, kind, skip)
    return (statistics.median(found), covered) if found else (None, 0)


def _detectable(se: float, df: float, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest difference (in %, of a ratio near 1) that runs with this standard
    error of the log ratio detect with `power` at `confidence`: (t_{1-alpha/2} + t_power) * se."""
    from scipy import stats

    return 100.0 * math.expm1((stats.t.ppf(0.5 + confidence / 2, df) + stats.t.ppf(power, df)) * se)


def compare(a_ms: list[float], b_ms: list[float], confidence: float = 0.95, within: Optional[tuple[list[float], list[float]]] = None) -> dict:
    """Welch comparison of per-run step times (ms) of side A (original) and B
    (patched), on their logarithms: the ratio is a ratio of geometric means, and its
    interval exp(the log difference's interval) is never negative.

    Returns: mean_a, mean_b (geometric means, ms), sd_a, sd_b (ms; None with one run),
    ratio (mean_b / mean_a), pct (100 * (ratio - 1): > 0 slower), ci_ratio ([low,
    high], or None with fewer than 2 runs a side), pct_half (half the interval's width,
    % of the ratio), p (Welch's t-test on the logs, two-sided; None with fewer than 2
    runs a side), resolution_pct (the smallest difference these runs could detect, 95 %
    confidence and 80 % power; with one run a side, from `within`: the windows of each
    run, labelled by basis), basis ("between runs", "within one run each" or None).
    Two sides with no spread at all: p 0 where their means differ, 1 where equal, the
    interval the ratio itself. Raises ValueError when a side is empty or holds a
    step time that is not positive.
    """
    if not a_ms or not b_ms:
        raise ValueError("compare needs at least one run a side")
    if min(a_ms + b_ms) <= 0:
        raise ValueError(f"a step time is not positive: {min(a_ms + b_ms)} ms")
    la, lb = [math.log(v) for v in a_ms], [math.log(v) for v in b_ms]
    diff = statistics.fmean(lb) - statistics.fmean(la)
    out = {
        "mean_a": math.exp(statistics.fmean(la)), "mean_b": math.exp(statistics.fmean(lb)),
        "sd_a": statistics.stdev(a_ms) if len(a_ms) > 1 else None,
        "sd_b": statistics.stdev(b_ms) if len(b_ms) > 1 else None,
        "ratio": math.exp(diff), "pct": 100.0 * math.expm1(diff), "ci_ratio": None, "pct_half": None, "p": None,
        "resolution_pct": None, "basis": None,
    }
    if len(a_ms) < 2 or len(b_ms) < 2:
        if within and len(within[0]) > 1 and len(within[1]) > 1 and min(within[0] + within[1]) > 0:
            wa, wb = [math.log(v) for v in within[0]], [math.log(v) for v in within[1]]
            se = math.sqrt(statistics.variance(wa) / len(wa) + statistics.variance(wb) / len(wb))
            out.update(resolution_pct=_detectable(se, len(wa) + len(wb) - 2, confidence), basis="within one run each")
        return out
    va, vb = statistics.variance(la), statistics.variance(lb)
    if va == 0 and vb == 0:
        low = high = diff
        p = 1.0 if diff == 0 else 0.0
        resolution = 0.0
    else:
        from scipy import stats

        test = stats.ttest_ind(lb, la, equal_var=False)
        interval = test.confidence_interval(confidence)
        low, high, p = float(interval.low), float(interval.high), float(test.pvalue)
        resolution = _detectable(math.sqrt(va / len(la) + vb / len(lb)), float(test.df), confidence)
    out.update(ci_ratio=[math.exp(low), math.exp(high)], p=p, pct_half=100.0 * (math.exp(high) - math.exp(low)) / 2.0,
               resolution_pct=resolution, basis="between runs")
    return out


def _pct(value: float) -> str:
    """A percentage with two significant decimals where it is small."""
    value = abs(value)
    return f"{value:.2f}" if value < 0.995 else f"{value:.1f}"


def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}" if p < 0.0995 else f"p = {p:.2f}"


def resolution_words(stats: dict) -> str:
    """The smallest difference the runs could detect, in words ("" where none is known)."""
    if stats.get("resolution_pct") is None:
        return ""
    basis = " (from each run's windows alone: run-to-run spread unknown)" if stats["basis"] == "within one run each" else ""
    return f"a difference under {_pct(stats['resolution_pct'])} % cannot be seen with these runs{basis}"


def verdict(stats: dict, runs_each: int, fallbacks: int = 0, patched_runs: int = 0) -> str:
    """The comparison in words: "faster by 0.8 % ± 0.3 % (p = 0.002, 10 runs each; a
    difference under 0.4 % cannot be seen with these runs)", "slower by ...", "no
    difference within noise (...)" where the 95 % CI includes 1 or p >= 0.05, "too
    noisy to say anything (...)" where the runs cannot see NOISY_PCT %, and with one run
    a side no direction at all. `stats` is `compare`'s; a producer fallback in any of
    `patched_runs` is said beside."""
    direction = "slower" if stats["pct"] > 0 else "faster"
    seen = resolution_words(stats)
    if stats["p"] is None:
        words = f"no verdict from one run each (ratio {stats['ratio']:.4f}{'; ' + seen if seen else ''})"
    else:
        low, high = stats["ci_ratio"]
        figure = f"{_pct(stats['pct'])} % ± {_pct(stats['pct_half'])} %"
        detail = f"{_p(stats['p'])}, {runs_each} runs each; {seen}"
        if low <= 1 <= high or stats["p"] >= ALPHA:
            signed = f"{'+' if stats['pct'] >= 0 else '-'}{figure}"
            noisy = stats["resolution_pct"] is not None and stats["resolution_pct"] > NOISY_PCT
            words = f"{'too noisy to say anything' if noisy else 'no difference within noise'} (ratio {stats['ratio']:.4f}, {signed}, {detail})"
        else:
            words = f"{direction} by {figure} ({detail})"
    if fallbacks:
        words += f"; the producer fell back in {fallbacks} of {patched_runs} patched runs (those ran without prefetch)"
    return words


def flag_outliers(done: list["RunResult"]) -> None:
    """Mark each run whose level (step time) or within-run spread lies more than
    OUTLIER_MADS scaled median absolute deviations from its side's (3 runs a side at
    least), and at least 2 % away: a run the user should look at (contention, a
    throttled GPU)."""
    for side in "ab":
        runs = [r for r in done if r.side == side and r.step_ms]
        if len(runs) < 3:
            continue
        for attr, floor, what in (("step_ms", 0.02, "level"), ("spread_pct", 2.0, "within-run spread")):
            values = [getattr(r, attr) for r in runs if getattr(r, attr) is not None]
            if len(values) < 3:
                continue
            middle = statistics.median(values)
            mad = 1.4826 * statistics.median(abs(v - middle) for v in values)
            for r in runs:
                value = getattr(r, attr)
                gap = abs(value - middle) if value is not None else 0.0
                if gap > OUTLIER_MADS * mad and gap > (floor * middle if attr == "step_ms" else floor):
                    r.outlier = f"{what} {value:.3f} against its side's median {middle:.3f}"


def run_ab(
    original: str,
    patched: str,
    *,
    runs: int = DEFAULT_RUNS,
    steps: int = DEFAULT_STEPS,
    skip: Optional[int] = None,
    nproc_per_node: Optional[int] = None,
    cwd: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
    env_b: Optional[dict[str, str]] = None,
    label_a: str = "original",
    label_b: str = "patched",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tokens_per_step: Optional[int] = None,
    step_regex: Optional[str] = None,
    script_args: Optional[list[str]] = None,
    python: Optional[str] = None,
    on_run: Optional[Callable[[RunResult, int], None]] = None,
    log_every: int = DEFAULT_LOG_EVERY,
    until_pct: Optional[float] = None,
    budget_s: Optional[float] = None,
) -> dict:
    """Run ORIGINAL (side A) and PATCHED (side B) alternately, `runs` times each, every
    run stopped at `steps` steps, and compare their mean step times (ms).

    skip: steps left out at the start of each run (default `default_skip(steps)`);
    nproc_per_node: run under torchrun with this many processes (None: plain python);
    cwd: the runs' working directory (default the current one); env: NAME -> VALUE for
    both sides, env_b for side B only (on top of os.environ and `step_env`);
    tokens_per_step: for a tok/s log (default TRAIN_BATCH_TOKENS of the side's env);
    step_regex: a `custom_format` tried before the built-in formats; script_args:
    passed to both scripts; python: the interpreter that runs both (the training
    environment's, with its CUDA torch; default this one); on_run(result, total): called
    after each run; log_every: steps between two log lines of a run (a window);
    until_pct: keep alternating pairs of runs (at least 2 a side, `runs` at most) until
    the ratio's 95 % interval is narrower than ±until_pct %, or `budget_s` seconds have
    passed (the report's "ended_by" says which).

    Returns the report (see `format_report`; JSON-ready): "original", "patched",
    "labels", "runs_each", "steps", "skip", "commands", "step_env" (what every run gets
    before --env), "env", "env_b", "cwd", "format"
    (per side), "runs" (one dict per run, in run order), "step_ms" (per side, one mean
    per run, ms), "mean_ms", "sd_ms", "ratio", "ci" (the ratio's 95 % interval, or
    None), "pct", "pct_half", "p", "fallbacks", "patched_runs", "verdict".
    Raises AbError (one line) for bad input (a missing script, runs < 1, steps <= skip),
    a run that cannot start, fails (exits non-zero or times out before step S) or
    prints no recognised step line, or a tok/s log without tokens a step.
    """
    env, env_b, script_args = dict(env or {}), dict(env_b or {}), list(script_args or [])
    scripts = {"a": Path(original), "b": Path(patched)}
    for path in scripts.values():
        if not path.is_file():
            raise AbError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    if runs < 1:
        raise AbError(f"--runs {runs}: needs at least 1")
    if steps < 2:
        raise AbError(f"--steps {steps}: needs at least 2")
    if log_every < 1:
        raise AbError(f"--log-every {log_every}: needs at least 1")
    if until_pct is not None and not until_pct > 0:
        raise AbError(f"--until {until_pct}: needs a width above 0 %")
    skip = default_skip(steps) if skip is None else skip
    if not 0 <= skip < steps:
        raise AbError(f"--skip {skip}: must be at least 0 and below --steps {steps}")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise AbError(f"--nproc-per-node {nproc_per_node}: needs at least 1")
    if python is not None and shutil.which(python) is None:  # a name on PATH, or a path to an executable file
        raise AbError(f"--python {python}: no such interpreter")
    workdir = str(Path(cwd or os.getcwd()).resolve())
    if not Path(workdir).is_dir():
        raise AbError(f"{cwd}: --cwd is not a directory")
    formats = ((custom_format(step_regex),) if step_regex else ()) + LOG_FORMATS
    labels = {"a": label_a, "b": label_b}
    envs = {side: run_env(steps, env, env_b, side, log_every=log_every) for side in "ab"}
    cache = None
    if not any(name in {**os.environ, **env} for name in COMPILE_CACHES):
        # one compile cache for both sides: only the first run pays the compile
        cache = tempfile.mkdtemp(prefix="patch-prefetch-ab-cache-")
        for side in "ab":
            envs[side].update({name: os.path.join(cache, name.lower()) for name in COMPILE_CACHES})
    tokens = {side: tokens_per_step or _int_or_none(envs[side].get("TRAIN_BATCH_TOKENS")) for side in "ab"}
    commands = {side: run_command(scripts[side].resolve(), nproc_per_node, step_args(scripts[side], steps, script_args) + script_args, python) for side in "ab"}
    done: list[RunResult] = []
    started, ended_by = time.monotonic(), "runs"
    try:
        with _stops_as_interrupts():
            for index in range(2 * runs):
                side = "ab"[index % 2]
                result = RunResult(index=index + 1, side=side, label=labels[side], script=str(scripts[side]))
                run_once(result, commands[side], envs[side], workdir, steps, timeout_s, formats, tokens[side])
                _judge_run(result, steps, skip, formats)
                done.append(result)
                if on_run is not None:
                    on_run(result, 2 * runs)
                if side == "b" and until_pct is not None and index >= 3:
                    stats = _compare_runs(done)
                    if stats["pct_half"] is not None and stats["pct_half"] < until_pct:
                        ended_by = f"the interval: ±{_pct(stats['pct_half'])} % < ±{_pct(until_pct)} %"
                        break
                if side == "b" and budget_s is not None and time.monotonic() - started >= budget_s:
                    ended_by = f"the budget: {time.monotonic() - started:.0f} s of --budget {budget_s:.0f} s"
                    break
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    flag_outliers(done)
    report = _report(done, scripts, labels, len(done) // 2, steps, skip, commands, env, env_b, workdir, log_every)
    report["ended_by"] = ended_by if until_pct is not None or budget_s is not None else f"the runs asked for ({runs} each)"
    report["compile_cache"] = "shared by both sides (a temporary directory)" if cache is not None else "the caller's (TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR set)"
    return report


COMPILE_CACHES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@contextlib.contextmanager
def _stops_as_interrupts():
    """SIGTERM (a scheduler, `timeout`) and SIGHUP (a closed terminal) stop ab as Ctrl-C
    does: the running script's process group is killed first (`run_once`), then the
    command says "interrupted". Only from the main thread, where handlers can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _compare_runs(done: list[RunResult]) -> dict:
    """`compare` of the runs so far, with each side's first run's windows for one run a side."""
    per_side = {side: [r.step_ms for r in done if r.side == side] for side in "ab"}
    first = {side: next((r.windows for r in done if r.side == side), []) for side in "ab"}
    return compare(per_side["a"], per_side["b"], within=(first["a"], first["b"]))


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def _judge_run(result: RunResult, steps: int, skip: int, formats: tuple[LogFormat, ...]) -> None:
    """Measure `result`, or raise AbError saying why the run failed."""
    where = f"run {result.index} ({result.label}, {result.script})"
    tail = " | ".join(line.strip() for line in result.stderr_tail[-SHOWN_TAIL:] if line.strip())
    if result.error is not None:
        raise AbError(f"{where}: {result.error}")
    if result.timed_out:
        raise AbError(f"{where} failed: no step {steps} within --timeout (reached step {result.steps_reached}); last stderr: {tail or '(none)'}")
    if result.returncode not in (None, 0):
        raise AbError(f"{where} failed: exit code {result.returncode} before step {steps} (reached step {result.steps_reached}); last stderr: {tail or '(none)'}")
    if result.format is None:
        sample = " | ".join(line.strip()[:120] for line in (result.stdout_tail or result.stderr_tail)[-3:] if line.strip())
        known = "; ".join(f.example for f in formats)
        raise AbError(f"{result.script}: no step line recognised in its output (known: {known}; else give --step-regex); its output ended: {sample or '(nothing)'}")
    kind = next(f.kind for f in formats if f.name == result.format)
    result.windows, result.steps_measured = windows(result.points, kind, skip)
    result.step_ms = statistics.median(result.windows) if result.windows else None  # `step_ms`, on the windows just found
    if result.step_ms and len(result.windows) > 1:
        result.spread_pct = 100.0 * statistics.stdev(result.windows) / result.step_ms
    if result.step_ms is None:
        raise AbError(f"{where}: too few {result.format} step lines after step {skip} to time a step (reached step {result.steps_reached}; lower --skip, or log every step)")


def _report(done: list[RunResult], scripts: dict, labels: dict, runs: int, steps: int, skip: int, commands: dict, env: dict, env_b: dict, cwd: str,
            log_every: int = DEFAULT_LOG_EVERY) -> dict:
    per_side = {side: [r.step_ms for r in done if r.side == side] for side in "ab"}
    stats = _compare_runs(done)
    arrival = [r for r in done if r.format and r.format == "step lines timed on arrival"]
    patched_runs = [r for r in done if r.side == "b"]
    fallbacks = sum(r.fell_back for r in patched_runs)
    formats = {side: sorted({r.format for r in done if r.side == side}) for side in "ab"}
    return {
        "original": str(scripts["a"]), "patched": str(scripts["b"]), "labels": labels,
        "runs_each": runs, "steps": steps, "skip": skip, "cwd": cwd,
        "commands": commands, "step_env": step_env(steps, log_every), "env": env, "env_b": env_b, "log_every": log_every,
        "format": {side: ", ".join(names) for side, names in formats.items()},
        "runs": [r.as_dict() for r in done],
        "step_ms": {side: [round(v, 4) for v in values] for side, values in per_side.items()},
        "mean_ms": {"a": round(stats["mean_a"], 4), "b": round(stats["mean_b"], 4)},
        "sd_ms": {"a": _round(stats["sd_a"]), "b": _round(stats["sd_b"])},
        "ratio": round(stats["ratio"], 6),
        "ci": None if stats["ci_ratio"] is None else [round(v, 6) for v in stats["ci_ratio"]],
        "pct": round(stats["pct"], 4), "pct_half": _round(stats["pct_half"]), "p": stats["p"],
        "resolution_pct": _round(stats["resolution_pct"]), "resolution_basis": stats["basis"], "resolution": resolution_words(stats),
        "first_step_s": {side: [_round(r.first_step_s, 2) for r in done if r.side == side] for side in "ab"},
        "outliers": [f"run {r.index} ({r.label}): {r.outlier}" for r in done if r.outlier],
        "warnings": _warnings(stats, arrival),
        "fallbacks": fallbacks, "patched_runs": len(patched_runs),
        "verdict": verdict(stats, runs, fallbacks, len(patched_runs)),
    }


def _warnings(stats: dict, arrival: list[RunResult]) -> list[str]:
    """What the user should know before reading the figures."""
    out = []
    if not gpu_present():
        out.append("no GPU on this machine: these are CPU step times, not what a GPU run shows")
    if stats["resolution_pct"] is not None and stats["resolution_pct"] > NOISY_PCT:
        out.append(f"too noisy to say anything about a gain of about 1 %: {resolution_words(stats)}; more runs (--until), longer runs (--steps) or a quieter machine")
    if arrival:
        out.append("the step lines carry no cumulative time: they are timed on arrival, which adds whatever sync the log line makes (a `.item()` each) every --log-every steps")
    return out


def gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU (its driver's device nodes or nvidia-smi)."""
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def _round(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def run_line(run: dict) -> str:
    """One run of a report, in words: its label, mean step ms, steps measured, and the
    producer's fallback or `prefetch:` lines where it printed any."""
    ms = "-" if run["step_ms"] is None else f"{run['step_ms']:.3f} ms/step"
    spread = "" if run.get("spread_pct") is None else f", spread ±{run['spread_pct']:.2f} % over {run['windows']} windows"
    first = "" if run.get("first_step_s") is None else f", first step line after {run['first_step_s']:.1f} s"
    how = f"steps measured {run['steps_measured']}{spread}{first}" + ("" if run["stopped_at_steps"] else f", it ended by itself at step {run['steps_reached']}")
    line = f"  run {run['index']:>2}  {run['label']:12} {ms:>16}  ({how})"
    if run["fell_back"]:
        line += "  PRODUCER FELL BACK"
    if run.get("outlier"):
        line += f"  OUTLIER: {run['outlier']}"
    for quoted in run["prefetch_lines"][:3]:
        line += f"\n      {quoted}"
    return line


def format_report(report: dict) -> str:
    """The report of `run_ab` as text: the setup, one line per run, the means, the ratio
    with its 95 % interval, the fallbacks, and the verdict (last line)."""
    la, lb = report["labels"]["a"], report["labels"]["b"]
    fmt = report["format"]["a"] if report["format"]["a"] == report["format"]["b"] else f"{la}: {report['format']['a']}; {lb}: {report['format']['b']}"
    lines = [
        f"ab: {la} = {report['original']}, {lb} = {report['patched']}: {report['runs_each']} runs each, alternated, "
        f"stopped at step {report['steps']}, the first {report['skip']} steps left out, a log line every {report.get('log_every', DEFAULT_LOG_EVERY)} steps; log format: {fmt}",
    ]
    lines += [run_line(run) for run in report["runs"]]
    for side, label in (("a", la), ("b", lb)):
        sd = report["sd_ms"][side]
        lines.append(f"  {label}: {report['mean_ms'][side]:.3f} ms/step (geometric mean of the runs)" + ("" if sd is None else f", sd {sd:.3f} ms over {report['runs_each']} runs"))
    ci = "" if report["ci"] is None else f", 95 % CI [{report['ci'][0]:.4f}, {report['ci'][1]:.4f}]"
    p = "" if report["p"] is None else f", {_p(report['p'])} (Welch, on the logs)"
    lines.append(f"  {lb}/{la} step time: {report['ratio']:.4f}{ci}{p}")
    if report.get("resolution"):
        lines.append(f"  resolution: {report['resolution']}")
    if report.get("first_step_s"):
        firsts = {side: [v for v in values if v is not None] for side, values in report["first_step_s"].items()}
        lines.append(f"  time to the first step line (compile, start-up; not in the step time): {la} {', '.join(f'{v:.1f}' for v in firsts['a'])} s; {lb} {', '.join(f'{v:.1f}' for v in firsts['b'])} s")
    if report.get("ended_by"):
        lines.append(f"  ended by {report['ended_by']}")
    for warning in report.get("warnings", []):
        lines.append(f"  warning: {warning}")
    lines.append(f"  producer fell back in {report['fallbacks']} of {report['patched_runs']} {lb} runs")
    said = report["verdict"]
    lines.append(f"verdict: {lb} {said}" if said.startswith(("faster", "slower", "the same")) else f"verdict: {said}")
    return "\n".join(lines)

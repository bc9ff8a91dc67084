"""The pipeline on small sources: the runtime in a minified script, patching twice, unknown features.

The tables of each feature are in tests/test_feature_<name>.py, those of each loader
family in tests/test_family_<name>.py.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
import python_minifier

from patcher.cst_walk import walk
from patcher.patch import features_from, patch_source
from patcher.survey.survey import survey

LOADER = '''
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class TokenStream:
    def __init__(self, pattern):
        self.tokens = torch.arange(10_000)
        self.pos = 0

    def take(self, n):
        out = self.tokens[self.pos : self.pos + n]
        self.pos += n
        return out

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local_tokens = global_tokens // (self.world_size * grad_accum_steps)
        chunk = self.stream.take((local_tokens + 1) * self.world_size)
        local = chunk[: local_tokens + 1].to(dtype=torch.int64)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
'''


def script(main_body: str, loader: str = LOADER) -> str:
    return loader + "\ndef main():\n" + textwrap.indent(textwrap.dedent(main_body), "    ")


CONSTANT_LOOP = """
args = Hyperparameters()
grad_accum_steps = 8 // int(os.environ.get("WORLD_SIZE", "1"))
train_loader = DistributedTokenLoader("x", 0, 1, device)
for step in range(10):
    x, y = train_loader.next_batch(512, 64, grad_accum_steps)
"""


def test_runtime_in_a_minified_script_takes_its_tabs_and_no_docstrings():
    from test_feature_env_toggles import MINIFIED

    result = patch_source(MINIFIED)  # the script's own lines: test_feature_env_toggles.py
    assert "\n\tdef shutdown(self,until=float('inf')):" in result.runtime  # runtime indented with the script's tabs
    assert '"""' not in result.source.split("# patch-prefetch ", 1)[1].split("class Hyperparameters", 1)[0]  # no docstrings
    compile(result.source, "minified", "exec")


def test_runtime_in_a_minified_script_is_written_as_pyminify_writes_it():
    # The records count their code after `pyminify --no-rename-locals --no-hoist-literals
    # --remove-literal-statements`: the injected code already in that form costs no
    # counted byte that minifying would save.
    from test_feature_env_toggles import MINIFIED

    runtime = patch_source(MINIFIED).runtime
    code = runtime.split("\n", 1)[1]  # after the header line
    assert "def _make_train_loader(make_loader,device," in code and ", " not in code and " = " not in code
    assert python_minifier.minify(code, rename_locals=False, hoist_literals=False, remove_literal_statements=True) == code.rstrip("\n")


def test_patching_twice_is_a_noop():
    once = patch_source(script(CONSTANT_LOOP)).source
    twice = patch_source(once)
    assert twice.already_patched
    assert twice.source == once
    assert not twice.changed


def test_unknown_feature_is_rejected():
    with pytest.raises(ValueError, match="unknown feature"):
        features_from(["warp_drive"], None)


def test_the_survey_finds_the_statement_of_every_node_and_cannot_be_written():
    # Transforms look nodes up (`Survey.top_level_of`), including nodes only one feature
    # cares about (an MLP's `.square()`); the index they look in is read-only.
    module = cst.parse_module(script(CONSTANT_LOOP) + "\nclass MLP:\n    def forward(self, x):\n        return self.proj(torch.relu(self.fc(x)).square())\n")
    surveyed = survey(module)
    for statement in module.body:
        # The index itself, not `top_level_of`, which falls back to a walk of the module.
        assert all(surveyed.collector.top_of.get(node) is statement for node in walk(statement))
    with pytest.raises(TypeError):
        surveyed.collector.top_of[module.body[0]] = module.body[-1]


def test_a_method_named_like_a_log_function_is_not_the_scripts_log_function():
    import libcst

    from patcher.survey.survey import survey

    method_only = "class Logger:\n    def log0(self, msg):\n        print(msg)\n"
    assert survey(libcst.parse_module(method_only)).log_function is None  # a bare `log0(...)` would be a NameError
    both = method_only + "\ndef log(msg):\n    print(msg)\n"
    name, fn = survey(libcst.parse_module(both)).log_function
    assert name == "log" and fn.name.value == "log"

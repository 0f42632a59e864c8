"""Every code block of README.md and docs/*.md is true as written.

* ``python`` blocks run, each in a fresh namespace in a temporary directory.
  A block that cannot run here (torchrun, a cluster, the network, minutes of
  compute) is preceded by ``<!-- skip-test: REASON -->``; skips must be rare.
* Every ``staleopt ...`` line of a ``bash`` or ``console`` block parses with
  the real command-line parser, and every ``toml`` block is a valid sweep file.
* Every fence names its language, so no block escapes these checks.
"""
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from staleopt import docgen, sweep
from staleopt.cli import build_parser


REPO = Path(__file__).resolve().parents[1]
PAGES = docgen.doc_files(REPO)
BLOCKS = [(page, block) for page in PAGES for block in docgen.code_blocks(page.read_text())]
PYTHON = [(page, block) for page, block in BLOCKS if block.lang == "python"]
#: At most this fraction of the python blocks may be skipped.
MAX_SKIPPED = 0.2


def _id(page, block):
    return f"{page.relative_to(REPO)}:{block.line}"


def test_every_page_is_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/wrapper.md", "docs/design.md"} <= names


def test_readme_has_examples():
    assert any(page.name == "README.md" for page, _ in PYTHON), "the README must show a runnable example"


def test_every_fence_names_its_language():
    bare = [_id(page, b) for page, b in BLOCKS if not b.lang]
    assert not bare, f"fences without a language (python, bash, console, toml, text, ...): {bare}"


def test_skipping_is_rare_and_explained():
    skipped = [(page, b) for page, b in PYTHON if b.skip is not None]
    for page, b in skipped:
        assert len(b.skip.split()) >= 3, f"{_id(page, b)}: say why the block cannot run in the tests"
    assert len(skipped) <= MAX_SKIPPED * len(PYTHON), \
        f"{len(skipped)} of {len(PYTHON)} python blocks are skipped; make them runnable"
    markers = sum(len(re.findall(r"^<!-- skip-test:", page.read_text(), re.M)) for page in PAGES)
    assert markers == len(skipped), "every skip-test marker must sit on the line just before a python block"


@pytest.mark.parametrize("page, block", [(p, b) for p, b in PYTHON if b.skip is None],
                         ids=[_id(p, b) for p, b in PYTHON if b.skip is None])
def test_python_block_runs(page, block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_example__"}
    exec(compile(block.code, _id(page, block), "exec"), namespace)
    if page.name == "README.md" and "stages=3, schedule=\"pipemare\"" in block.code:
        out = capsys.readouterr().out
        assert "[5, 3, 1] [0, 0, 0]" in out
        # the loss the comment quotes, as printed at the steps it names (2 decimals: stable across CPUs' rounding)
        said = re.search(r"falls from ([\d.]+) \(step (\d+)\) to ([\d.]+) \(step (\d+)\)", block.code)
        printed = {int(s): float(v) for s, v in re.findall(r"step +(\d+) +loss ([\d.]+)", out)}
        for value, step in ((said[1], said[2]), (said[3], said[4])):
            assert f"{printed[int(step)]:.2f}" == value, f"README says loss {value} at step {step}: {out}"


def _command_lines(block):
    """The commands of a shell block, continuation lines joined: in ``console`` blocks the ``$ `` lines."""
    for line in block.code.replace("\\\n", " ").splitlines():
        if block.lang == "console":
            if line.startswith("$ "):
                yield line[2:]
        elif line.strip():
            yield line


SHELL = [(p, b) for p, b in BLOCKS if b.lang in ("bash", "console")]


@pytest.mark.parametrize("page, block", SHELL, ids=[_id(p, b) for p, b in SHELL])
def test_cli_lines_parse(page, block):
    parser = build_parser()
    for line in _command_lines(block):
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_]+=", words[0]):  # environment assignments
            words.pop(0)
        if not words or words[0] != "staleopt":
            continue
        try:
            parser.parse_args(words[1:])
        except SystemExit as e:
            assert e.code == 0, f"{_id(page, block)}: `{line}` does not parse"


def test_cli_lines_are_checked():
    """The command-line check sees the commands the docs show."""
    seen = {line.split()[1] for _, b in SHELL for line in _command_lines(b) if line.startswith("staleopt ")}
    assert {"train", "sweep", "timeline", "hardware", "advise", "plot"} <= seen


TOML = [(p, b) for p, b in BLOCKS if b.lang == "toml"]


@pytest.mark.parametrize("page, block", TOML, ids=[_id(p, b) for p, b in TOML])
def test_toml_blocks_are_sweeps(page, block, monkeypatch):
    monkeypatch.chdir(REPO)  # a file spec ("experiments/tutorial_models.py:small_cnn") is relative to the checkout
    spec = sweep.from_spec(tomllib.loads(block.code), source=_id(page, block))
    assert spec.configs

"""Every ```python block of the README runs as written.

Blocks fenced as ```py are illustrations that need a cluster, files or minutes
(torchrun, a sweep directory, a full training run); they are not executed.
"""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert BLOCKS, "the README must show at least one runnable example"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    namespace = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
    if index == 0:
        assert "[5, 3, 1] [0, 0, 0]" in capsys.readouterr().out

"""README.md and docs/*.md: links resolve inside the repository, generated tables are current, the front page is short."""
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from staleopt import docgen, methods

REPO = Path(__file__).resolve().parents[1]
PAGES = docgen.doc_files(REPO)
README = REPO / "README.md"
#: Files whose text may not name places outside the repository (this test names them on purpose).
_OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/work/")


def _rel(path):
    return path.relative_to(REPO).as_posix()


def _targets():
    for page in PAGES:
        for link in docgen.links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            yield page, link


@pytest.mark.parametrize("page, link", list(_targets()), ids=[f"{_rel(p)}->{l}" for p, l in _targets()])
def test_relative_link_resolves(page, link):
    path, _, anchor = unquote(link).partition("#")
    target = (page.parent / path).resolve() if path else page
    assert target.is_relative_to(REPO), f"{_rel(page)} links outside the repository: {link}"
    assert target.exists(), f"{_rel(page)}: {link} points to a missing file"
    if anchor:
        assert target.suffix == ".md", f"{_rel(page)}: {link}: anchors only into Markdown pages"
        assert anchor in docgen.anchors(target.read_text()), \
            f"{_rel(page)}: {link}: no heading with anchor #{anchor} in {_rel(target)}"


def test_links_are_found():
    """The link check sees the links (a broken pattern would pass every page vacuously)."""
    readme = set(docgen.links(README.read_text()))
    assert {"docs/index.md", "docs/design.md", "docs/img/accuracy_vs_stages.png"} <= readme


def test_no_reference_outside_the_repository():
    """Scans the repository's own files; build outputs and environments (.gitignore) are not the repository."""
    ignored = {".git", ".venv", "runs", "build", "dist", "__pycache__", ".pytest_cache", ".ipynb_checkpoints",
               "bench_results"}
    offenders = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if ignored & set(parts) or any(p.endswith(".egg-info") for p in parts) or not path.is_file() \
                or path == Path(__file__).resolve():
            continue
        if path.suffix not in {".py", ".md", ".toml", ".cfg", ".ipynb", ".txt", ".yml", ".yaml", ".sh"} \
                and path.name not in {"Makefile", "run"}:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                offenders.append(f"{_rel(path)}:{n}: {line.strip()[:80]}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_generated_blocks_are_current():
    texts = {page: page.read_text() for page in PAGES}
    names = {name for text in texts.values() for name in docgen.block_names(text)}
    rendered = {name: docgen.GENERATORS[name]() for name in names & set(docgen.GENERATORS)}
    stale = [_rel(page) for page, text in texts.items() if docgen.fill(text, rendered) != text]
    assert not stale, f"run `python -m staleopt.docgen`: stale generated blocks in {stale}"


def test_readme_methods_table_is_generated_from_staleopt_methods():
    text = README.read_text()
    assert "methods-table" in docgen.block_names(text)
    block = re.search(r"<!-- methods-table:begin -->\n(.*?)<!-- methods-table:end -->", text, re.S).group(1)
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `([^`]+)`", r).group(1) for r in rows] == methods.names()
    for row, method in zip(rows, methods.table()):
        assert f"`{method['schedule']}`" in row and method["paper"] in row


def test_fill_replaces_only_known_blocks():
    text = "a\n<!-- x:begin -->\nold\n<!-- x:end -->\n<!-- y:begin -->\nkeep\n<!-- y:end -->\n"
    assert docgen.fill(text, {"x": "new\n"}) == text.replace("old", "new")
    assert docgen.block_names(text) == ["x", "y"]


def test_anchors_follow_github():
    text = "# A title\n## 1. Semantics (the contract)\n## `torch.compile` with inductor\n## A title\n```\n# no\n```\n"
    assert docgen.anchors(text) == ["a-title", "1-semantics-the-contract", "torchcompile-with-inductor", "a-title-1"]


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move details to docs/"
    first = docgen.code_blocks("\n".join(lines[:25]))
    assert first and first[0].lang == "bash", "the first screen shows the two commands"
    commands = [line.split("#")[0].strip() for line in first[0].code.splitlines()]
    assert commands == ["make demo", "make test"]
    for marker in ("<!-- demo-claims:begin -->", "<!-- demo-claims:end -->"):
        assert marker in README.read_text()


def test_index_lists_every_page():
    index = (REPO / "docs" / "index.md").read_text()
    listed = {l.partition("#")[0] for l in docgen.links(index)}
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs/index.md does not list {sorted(pages - listed)}"


def test_python_requires_matches_the_code():
    """tomllib (Python 3.11) is imported without a fallback, so setup.cfg and the README say 3.11."""
    cfg = (REPO / "setup.cfg").read_text()
    assert re.search(r"^python_requires = >=3\.11$", cfg, re.M)
    assert "Python ≥ 3.11" in README.read_text() and "3.9" not in README.read_text()


def test_design_citations_in_the_code_have_a_section():
    """Code cites the design contract as "docs/design.md §N", and docs/design.md has every such §N."""
    design = (REPO / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", design, re.M))
    cited = {}
    for path in [*(REPO / "staleopt").rglob("*.py"), *(REPO / "tests").glob("*.py")]:
        text = path.read_text()
        assert "DESIGN" + " §" not in text, f"{_rel(path)} cites the design contract by its old name: cite docs/design.md §N"
        for m in re.finditer(r"design\.md (§\d+(?:, §\d+)*)", text):
            for n in re.findall(r"\d+", m.group(1)):
                cited.setdefault(n, _rel(path))
    assert {"1", "2", "3", "4", "5"} <= set(cited), "the code's design citations were not found"
    missing = {n: where for n, where in cited.items() if n not in sections}
    assert not missing, f"docs/design.md has no section for these citations: {missing}"


def test_api_reference_has_every_public_function_with_its_signature():
    import inspect
    import staleopt
    text = (REPO / "docs" / "api.md").read_text()
    for name in staleopt.__all__:
        obj = getattr(staleopt, name)
        if inspect.isfunction(obj):
            assert f"`def {name}{docgen._signature(obj)}`" in text, name
    assert "`def compare(" in text and "`def register_model(" in text and "### `staleopt.registry`" in text


def test_the_corrections_sweep_numbers_are_its_committed_records():
    """docs/performance.md's corrections sweep states what its committed records give (not retyped): the summary is
    the records' and each method's best accuracy on the page is the summary's."""
    import pandas as pd
    from staleopt import stats, sweep
    folder = REPO / "docs" / "corrections-sweep"
    summary = sweep.summarize(pd.read_csv(folder / "records.csv"))
    pd.testing.assert_frame_equal(summary, pd.read_csv(folder / "summary.csv"), check_dtype=False)
    section = (REPO / "docs" / "performance.md").read_text().split("## The corrections sweep")[1].split("\n## ")[0]
    text = " ".join(section.split())
    names = {"gpipe": "GPipe", "pipemare-w": "PipeMareW", "pipemare-stash": "dataflow + stashing",
             "pipemare-t1": "T1 alone", "pipemare": "PipeMare (T1 + T2)"}
    for r in summary.itertuples():
        if r.method in names:
            assert f"{names[r.method]} {stats.interval_text(r.best_acc, r.best_acc_lo, r.best_acc_hi)}" in text
    assert (summary.loc[summary["method"] == "dataflow", "status"] == "diverged").all()

"""Execute every notebook in notebooks/ in place, so that the committed notebooks carry their outputs.

    python experiments/run_notebooks.py            # all of them (make notebooks)
    python experiments/run_notebooks.py reproductions.ipynb

Each notebook runs from the repository root on its full inputs: the demo's
records from runs/demo (else the committed docs/demo/records.csv), the ledger's
from runs/reproduce (or $STALEOPT_LEDGER_DIR), the hardware model and the theory
as they are. Without a ledger run the ledger's notebook is left as committed
(run `make reproduce` first): executed, it would show its tiny stand-in ledger
instead. A notebook that raises stops the script with its error; nothing is
written for it.
tests/test_notebooks.py runs every notebook on small inputs and checks that the
committed ones have their outputs and name no path outside the repository.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(path: Path, timeout: int = 3600) -> None:
    """Execute ``path`` in place (kernel ``python3``, cwd the repository root) and write it back with outputs."""
    import nbclient
    import nbformat
    nb = nbformat.read(path, as_version=4)
    os.environ.pop("STALEOPT_NOTEBOOK_SMALL", None)     # the full inputs, not the tests' small ones
    os.environ["MPLBACKEND"] = "Agg"
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}}).execute()
    for cell in nb.cells:   # warnings an installed package prints (tqdm without ipywidgets) are this machine's
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr"
                                                            and "site-packages" in o.text)]
    nbformat.write(nb, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="notebook file names in notebooks/ (default: all)")
    args = p.parse_args(argv)
    paths = [REPO / "notebooks" / n for n in args.names] or sorted((REPO / "notebooks").glob("*.ipynb"))
    for path in paths:
        if not path.is_file():
            print(f"no notebook {path}", file=sys.stderr)
            return 2
        if path.name == "reproductions.ipynb" and not (ledger_dir() / "runs").is_dir():
            print(f"kept {path.relative_to(REPO)} as committed: no ledger run in {ledger_dir()} (make reproduce "
                  "writes one; executed without it, the notebook shows its tiny stand-in ledger)", file=sys.stderr)
            continue
        print(f"running {path.relative_to(REPO)}", flush=True)
        run(path)
    return 0


def ledger_dir() -> Path:
    """The ledger's sweep directory the notebook reads (its cell 1): ``$STALEOPT_LEDGER_DIR``, else runs/reproduce."""
    return REPO / os.environ.get("STALEOPT_LEDGER_DIR", "runs/reproduce")


if __name__ == "__main__":
    sys.exit(main())

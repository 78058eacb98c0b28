"""``python -m nbddp export NOTEBOOK.ipynb -o train.py [-n N]``: a notebook as a torchrun script."""

from __future__ import annotations

import argparse
import sys

from .notebook.export import check_target, export_notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbddp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser("export", help="write a notebook's %%ddp cells as a torchrun script")
    ex.add_argument("notebook", help="the .ipynb file")
    ex.add_argument("-o", "--output", required=True, help="the script to write")
    ex.add_argument("-n", type=int, help="--nproc-per-node (default: the notebook's -n)")
    ex.add_argument(
        "--force", action="store_true", help="write over an existing file (never a .ipynb)"
    )
    args = parser.parse_args(argv)
    try:
        check_target(args.output, force=args.force)
        result = export_notebook(args.notebook, args.n, target=args.output)
    except (OSError, ValueError) as exc:
        print(f"nbddp export: {exc}", file=sys.stderr)
        return 1
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(result.script)
    print(f"wrote {args.output}: run it with {result.command(args.output)}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m minivllm.course export|strip|check`` — keep package and notebooks in sync.

* ``export [--check] [--notebook PATH] [--out DIR]``: solutions (or one notebook) -> modules
* ``strip [--check]``: solutions -> learner notebooks
* ``check``: both ``--check`` runs; exit 1 when anything is stale or missing.

``--check`` writes nothing: it lists each stale or missing file with a diff head and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .notebooks import CourseError, export_all, export_notebook, strip_all

_CLI = "python -m minivllm.course"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_CLI, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write minivllm/<module>.py from notebooks")
    export.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    export.add_argument("--notebook", type=Path, help="export only this notebook's modules")
    export.add_argument("--out", type=Path, help="write modules here instead of the package")
    strip = commands.add_parser("strip", help="write notebooks/ from solutions/")
    strip.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    commands.add_parser("check", help="export --check and strip --check")
    for sub in commands.choices.values():
        sub.add_argument("--root", type=Path, help="repository root (default: the package's)")
    return parser


def _report(stale: list[Path], fix: str, ok: str) -> int:
    """Turn a ``--check`` result into the one-line verdict and the exit status."""
    if stale:
        print(f"FAIL: {len(stale)} file(s) stale or missing; run {fix}")
        return 1
    print(f"OK: {ok}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (2 for a broken notebook)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "export" and args.notebook:
            files = export_notebook(args.notebook, args.out, root=args.root, check=args.check)
        elif args.command == "export":
            out = {"package_dir": args.out} if args.out else {}
            files = export_all(args.check, root=args.root, **out)
        elif args.command == "strip":
            files = strip_all(args.check, root=args.root)
        else:
            stale = export_all(True, root=args.root) + strip_all(True, root=args.root)
            return _report(stale, f"`{_CLI} export` and `{_CLI} strip`",
                           "package and notebooks/ match solutions/")
    except CourseError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        return _report(files, f"`{_CLI} {args.command}`", f"{args.command}: all files up to date")
    for path in files:
        print(f"wrote {path}")
    print(f"OK: {args.command} wrote {len(files)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

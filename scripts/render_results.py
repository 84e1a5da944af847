#!/usr/bin/env python3
"""Render the README's results table and docs/results.md from the files in docs/results/.

    .venv/bin/python scripts/render_results.py           # rewrite the blocks between the markers
    .venv/bin/python scripts/render_results.py --check   # exit 1 if the docs and the files disagree

A bench run with --publish does this itself (pdd_sglang/dev/results.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdd_sglang.dev.results import render  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on a difference")
    args = parser.parse_args(argv)
    changed = render(write=not args.check)
    if args.check and changed:
        print(f"out of date: {', '.join(changed)} (run scripts/render_results.py)")
        return 1
    print(("rendered " + ", ".join(changed)) if changed else "the docs agree with docs/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

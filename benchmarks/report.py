"""How every ``python -m jrlhf.bench`` benchmark hands back its report: one JSON object on stdout
and, with ``--out FILE``, the same text in a file.

The file is checked before the benchmark measures anything (a typo in a path should not cost a
16-minute run) and written whole or not at all: the text goes to a temporary file beside it,
which then replaces the target, so an interrupted run never leaves a truncated report over an
earlier one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out FILE``: also write the JSON report there."""
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON report here")


def check_out(parser: argparse.ArgumentParser, out: Path | None) -> None:
    """Refuse, in one line and before any work, an ``--out`` that cannot be written: a
    directory, or a file in a folder that does not exist or is not writable."""
    if out is None:
        return
    if out.is_dir():
        parser.error(f"--out {out} is a directory; give a file name for the JSON report")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        parser.error(f"--out {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"--out {out}: folder {folder} is not writable")


def write(report: dict[str, Any], out: Path | None) -> str:
    """The report's JSON text; with ``out``, also written there (atomically)."""
    text = json.dumps(report, indent=2)
    if out is not None:
        out = Path(out)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent or ".")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return text


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print the report as JSON on stdout and, with ``out``, write it there too."""
    print(write(report, out), flush=True)

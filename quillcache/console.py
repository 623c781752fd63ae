"""Where the commands print tables: one rule for every command.

A table goes to stdout unless stdout carries JSON (`--json -`), then to stderr, so
`--json - | jq` always gets JSON alone. On a terminal rich fits the table to its width;
written to a pipe or a file it is never cut to rich's default 80 columns (which turns
`1,000,000` into `1,000,…`): the table keeps its natural width.
"""

from __future__ import annotations

import sys

from rich.console import Console

# wide enough for any table of ours; rich does not pad lines to it
_UNBOUNDED_WIDTH = 100_000


def table_console(*, json_on_stdout: bool = False) -> Console:
    stream = sys.stderr if json_on_stdout else sys.stdout
    if stream.isatty():
        return Console(file=stream)
    return Console(file=stream, width=_UNBOUNDED_WIDTH, soft_wrap=True)

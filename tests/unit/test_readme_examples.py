"""The README's shell examples can be pasted: bash reads each block as written, and the router
example is a command line the router itself accepts (a ``\\`` followed by a comment would end the
command there and leave the rest as a second, broken one)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from pdd_sglang.router.config import parse_args

README = Path(__file__).resolve().parents[2] / "README.md"


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """The block's commands as bash would join them: a line ending in ``\\`` continues."""
    joined = re.sub(r"\\\n", " ", block)
    return [line for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_bash_block_parses():
    blocks = bash_blocks()
    assert len(blocks) >= 3, "the README's examples were not found"
    for block in blocks:
        result = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert result.returncode == 0, (block, result.stderr)


def test_no_line_continuation_is_followed_by_anything():
    for block in bash_blocks():
        for line in block.splitlines():
            assert not re.search(r"\\\s+\S", line), f"text after a line continuation: {line!r}"


def test_the_router_example_is_one_command_the_router_accepts():
    routers = [cmd for block in bash_blocks() for cmd in commands(block)
               if "pdd_sglang.router" in cmd]
    assert routers, "no router example in the README"
    for cmd in routers:
        argv = shlex.split(cmd, comments=True)
        config = parse_args(argv[argv.index("pdd_sglang.router") + 1:])
        assert config.prefills and config.mains, cmd

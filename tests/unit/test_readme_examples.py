"""The README's and docs/'s shell examples can be pasted, and their flag tables are the code's.

- bash reads each ``bash`` block as written, and the router examples are command lines the router
  itself accepts (a ``\\`` followed by a comment would end the command there and leave the rest as a
  second, broken one);
- every row of a flag table (a table whose header starts ``| flag |`` and has a ``default`` column)
  names flags that exist, with the code's defaults and, where a flag's help names its roles
  (``PDD prefill: ...``), those roles;
- the README's flag tables list every server and router flag but the debug ones, and those are named
  in the README and tabled under docs/;
- every ``--pdd-...`` flag the README or docs/ mention outside an HTML comment exists (placeholders
  for flags still to come live in ``<!-- TODO(lead): ... -->`` comments).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import typing
from pathlib import Path

import msgspec
import pytest

from pdd_sglang.router.config import build_parser, parse_args
from pdd_sglang.dev.debug_aids.flags import PddDebugArgs
from pdd_sglang.server_args import PddArgs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
ALL_DOCS = [README, *DOCS]
ROLES = {"prefill", "relay", "main"}
FLAG = re.compile(r"`(--[a-z][a-z0-9-]*[a-z0-9])`")


def bash_blocks(path: Path = README) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """The block's commands as bash would join them: a line ending in ``\\`` continues."""
    joined = re.sub(r"\\\n", " ", block)
    return [line for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_every_bash_block_parses():
    assert len(bash_blocks()) >= 2, "the README's examples were not found"
    for path in ALL_DOCS:
        for block in bash_blocks(path):
            result = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
            assert result.returncode == 0, (path.name, block, result.stderr)


def test_no_line_continuation_is_followed_by_anything():
    for path in ALL_DOCS:
        for block in bash_blocks(path):
            for line in block.splitlines():
                assert not re.search(r"\\\s+\S", line), \
                    f"{path.name}: text after a line continuation: {line!r}"


def test_the_router_example_is_one_command_the_router_accepts():
    readme_routers = [cmd for block in bash_blocks() for cmd in commands(block)
                      if "pdd_sglang.router" in cmd]
    assert readme_routers, "no router example in the README"
    for path in ALL_DOCS:
        for cmd in (cmd for block in bash_blocks(path) for cmd in commands(block)
                    if "pdd_sglang.router" in cmd):
            argv = shlex.split(cmd, comments=True)
            config = parse_args(argv[argv.index("pdd_sglang.router") + 1:])
            assert config.prefills and config.mains, (path.name, cmd)


def test_every_launch_line_uses_only_flags_that_exist():
    known = set(server_flags())
    launches = [cmd for block in bash_blocks() for cmd in commands(block)
                if "sglang.launch_server" in cmd]
    assert {"prefill", "relay", "main"} <= {
        shlex.split(cmd)[shlex.split(cmd).index("--pdd-role") + 1]
        for cmd in launches if "--pdd-role" in cmd}, "the README launches every role"
    for cmd in launches:
        for flag in re.findall(r"(--pdd-[a-z0-9-]+)", cmd):
            assert flag in known, f"README launch line: {flag} is not a PDD flag"


# --- flag tables -------------------------------------------------------------------------------

def server_flags() -> dict[str, tuple[object, set[str] | None]]:
    """``--pdd-...`` -> (default, the roles its help names, or None)."""
    flags = {}
    # The --pdd-debug-* flags too (patches/debug/ registers them: the test profile's servers).
    for field in [*msgspec.structs.fields(PddArgs), *msgspec.structs.fields(PddDebugArgs)]:
        help_text = typing.get_args(field.type)[1] if typing.get_origin(field.type) \
            is typing.Annotated else ""
        match = re.match(r"PDD (?:debug )?\(?([a-z/]+)\)?:", help_text)
        roles = set(match.group(1).split("/")) if match and \
            set(match.group(1).split("/")) <= ROLES else None
        flags["--" + field.name.replace("_", "-")] = (field.default, roles)
    return flags


def router_flags() -> dict[str, object]:
    """``--flag`` -> default (``"required"`` for a required one)."""
    flags = {}
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option] = "required" if action.required else action.default
    return flags


def flag_rows(path: Path) -> list[tuple[list[str], list[str], str, str]]:
    """(flags, defaults, roles cell, the row) of every flag table's rows in ``path``."""
    rows, header = [], None
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(line) <= set("|-: ") or header[0] != "flag" or "default" not in header:
            continue
        flags = FLAG.findall(cells[0])
        defaults = [d.strip() for d in cells[header.index("default")].split(" / ")]
        role = cells[header.index("role")] if "role" in header else ""
        rows.append((flags, defaults, role, line))
    return rows


def parse_default(cell: str):
    cell = re.split(r" \(|: ", cell, maxsplit=1)[0].strip().strip("`")
    if cell in ("none", "off", "on", "required"):
        return {"none": None, "off": False, "on": True, "required": "required"}[cell]
    try:
        return float(cell)
    except ValueError:
        return cell


def same_default(code, doc) -> bool:
    if code in ([], ()):
        code = None
    if isinstance(code, bool) or isinstance(doc, bool) or code is None or doc is None:
        return code is doc
    if isinstance(code, (int, float)) and isinstance(doc, float):
        return float(code) == doc
    return str(code) == str(doc)


@pytest.mark.parametrize("path", ALL_DOCS, ids=lambda p: p.name)
def test_flag_tables_match_the_code(path):
    servers, routers = server_flags(), router_flags()
    for flags, defaults, role, line in flag_rows(path):
        assert flags, f"{path.name}: a flag row names no `--flag`: {line}"
        assert len(defaults) in (1, len(flags)), f"{path.name}: one default per flag: {line}"
        roles = {r.strip() for r in re.split(r"[,/]", role) if r.strip()}
        for flag, default in zip(flags, defaults * len(flags) if len(defaults) == 1 else defaults):
            if "router" in roles:
                assert flag in routers, f"{path.name}: the router has no {flag}: {line}"
                code_default = routers[flag]
            else:
                assert flag in servers, f"{path.name}: no PDD server flag {flag}: {line}"
                code_default, code_roles = servers[flag]
                if code_roles is not None and roles and roles != {"all"}:
                    assert roles == code_roles, \
                        f"{path.name}: {flag} is for {sorted(code_roles)} in its help: {line}"
            assert same_default(code_default, parse_default(default)), \
                f"{path.name}: {flag} defaults to {code_default!r} in the code: {line}"


def test_the_readme_tables_every_flag():
    tabled = {flag for flags, *_ in flag_rows(README) for flag in flags}
    everywhere = {flag for path in ALL_DOCS for flags, *_ in flag_rows(path) for flag in flags}
    text = README.read_text()
    for flag in [*server_flags(), *router_flags()]:
        if flag.startswith("--pdd-debug-"):
            assert flag in everywhere and f"`{flag}`" in text, \
                f"{flag}: name it in the README and table it under docs/"
        else:
            assert flag in tabled, f"{flag} is in the code but not in the README's flag table"


def test_every_pdd_flag_mentioned_exists():
    known = set(server_flags())
    for path in ALL_DOCS:
        text = re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)
        for flag in set(re.findall(r"--pdd-[a-z0-9-]*[a-z0-9]", text)):
            assert flag in known, f"{path.name} mentions {flag}, which is not a PDD flag"


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_lands():
    for path in ALL_DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file_part, _, fragment = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            assert linked.exists(), f"{path.name}: link to a missing file: {target}"
            if fragment and linked.suffix == ".md":
                headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)}
                assert fragment in headings, f"{path.name}: no heading #{fragment} in {file_part or path.name}"

#!/usr/bin/env python3
"""The table of configuration keys in docs/configuration.md, generated from CP_CONFIG_KEYS in csrc/core/cp.h.

    config_doc.py            print the table (Markdown)
    config_doc.py --check    exit 1 when docs/configuration.md's table differs from the generated one
    config_doc.py --write    rewrite docs/configuration.md's table in place

The table sits in docs/configuration.md between the lines `<!-- config-keys: begin -->` and
`<!-- config-keys: end -->`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "csrc" / "core" / "cp.h"
README = ROOT / "docs" / "configuration.md"
BEGIN = "<!-- config-keys: begin -->"
END = "<!-- config-keys: end -->"

# X(ID, "name", KIND, field, "default", "meaning"): string literals may hold commas.
ROW = re.compile(
    r'X\(\s*(?P<id>\w+)\s*,\s*"(?P<name>[^"]*)"\s*,\s*(?P<kind>\w+)\s*,\s*(?P<field>\w+)\s*,'
    r'\s*"(?P<default>[^"]*)"\s*,\s*"(?P<doc>(?:[^"\\]|\\.)*(?:"\s*"(?:[^"\\]|\\.)*)*)"\s*\)'
)
# Adjacent string literals ("..." "...") are one string in C: joined when read.
JOIN = re.compile(r'"\s*"')


def keys(header: Path = HEADER) -> list[dict[str, str]]:
    """The rows of CP_CONFIG_KEYS, in order."""
    text = header.read_text(encoding="utf-8")
    start = text.index("#define CP_CONFIG_KEYS(X)")
    body = []
    for line in text[start:].splitlines():
        body.append(line.rstrip().rstrip("\\"))
        if not line.rstrip().endswith("\\"):
            break
    rows = [m.groupdict() for m in ROW.finditer(" ".join(body))]
    for r in rows:
        r["doc"] = JOIN.sub("", r["doc"])
    if not rows:
        raise SystemExit(f"config_doc: no rows found in CP_CONFIG_KEYS of {header}")
    return rows


def table(rows: list[dict[str, str]]) -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{r['name']}` | {r['default']} | {r['doc']} |" for r in rows]
    return "\n".join(lines)


def readme_parts(text: str) -> tuple[str, str, str]:
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        body, tail = rest.split(END, 1)
    except ValueError:
        raise SystemExit(f"config_doc: the page lacks the lines {BEGIN} ... {END}") from None
    return head, body, tail


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail when the table is not the generated one")
    mode.add_argument("--write", action="store_true", help="rewrite the table in place")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    generated = table(keys())
    if not (args.check or args.write):
        print(generated)
        return 0
    text = args.readme.read_text(encoding="utf-8")
    head, body, tail = readme_parts(text)
    if args.write:
        args.readme.write_text(head + BEGIN + "\n" + generated + "\n" + END + tail, encoding="utf-8")
        return 0
    if body.strip() != generated:
        print(
            f"config_doc: the table in {args.readme.name} is not the one CP_CONFIG_KEYS gives; "
            "run `python3 scripts/config_doc.py --write`",
            file=sys.stderr,
        )
        return 1
    print(f"config_doc: {args.readme.name} lists the {len(keys())} keys of CP_CONFIG_KEYS")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

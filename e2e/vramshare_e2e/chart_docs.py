"""The chart's README, generated from the `# --` comments in its values.yaml (helm-docs' convention), so
the documentation of every value is written once, next to its default.

    python -m vramshare_e2e.chart_docs          # rewrite charts/vramshare/README.md
    python -m vramshare_e2e.chart_docs --check  # exit 1 when it is not current
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "vramshare"
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(?P<rest>.*)$")


def documented_values(text: str) -> list[tuple[str, str]]:
    """(dotted key, description) for every key preceded by a `# --` comment, in file order."""
    rows: list[tuple[str, str]] = []
    path: list[tuple[int, str]] = []
    comment: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and comment is not None:
            comment.append(stripped[1:].strip())
            continue
        match = _KEY.match(line)
        if match is None:
            if not stripped:
                comment = None
            continue
        indent = len(match["indent"])
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, match["key"]))
        if comment is not None:
            rows.append((".".join(k for _, k in path), " ".join(comment)))
        comment = None
    return rows


def _default(values: dict[str, Any], dotted: str) -> str:
    value: Any = values
    for part in dotted.split("."):
        value = value[part]
    return json.dumps(value, separators=(", ", ": "))


def render(chart: Path = CHART) -> str:
    text = (chart / "values.yaml").read_text()
    values = yaml.safe_load(text)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    lines = [
        f"# {meta['name']}",
        "",
        meta.get("description", ""),
        "",
        "Generated from `values.yaml` by `make chart-docs`; the tests check it is current. The manual",
        "(`docs/`, `make docs`) explains each feature; `values.schema.json` refuses wrong types and",
        "unknown keys.",
        "",
        *values_table(text, values),
    ]
    return "\n".join(lines) + "\n"


def values_table(text: str, values: dict[str, Any]) -> list[str]:
    """The Markdown table of every documented value: its default and its meaning (also the manual's
    reference page, vramshare_e2e.reference_docs)."""
    lines = ["| value | default | meaning |", "|---|---|---|"]
    for dotted, description in documented_values(text):
        default, meaning = _default(values, dotted).replace("|", r"\|"), description.replace("|", r"\|")
        lines.append(f"| `{dotted}` | `{default}` | {meaning} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vramshare_e2e.chart_docs")
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md is not current")
    args = parser.parse_args(argv)
    wanted = render()
    target = CHART / "README.md"
    if args.check:
        if not target.exists() or target.read_text() != wanted:
            print(f"{target} is not current: run python -m vramshare_e2e.chart_docs", file=sys.stderr)
            sys.exit(1)
        return
    target.write_text(wanted)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()

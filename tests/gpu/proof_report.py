"""The GPU proof's report: the parts' JSON results turned into Markdown (a verdict per part, then each part's
checks, tables, notes and error)."""

from typing import List


def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: List[str], rows: List[list]) -> List[str]:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def verdict(part: dict) -> str:
    if part.get("skipped"):
        return f"not run: {part['skipped']}"
    if part["ok"]:
        return "holds"
    failed = sum(not c["ok"] for c in part["checks"])
    return f"FAILS ({failed} of {len(part['checks'])} checks" + (", and an error" if part["error"] else "") + ")"


def render(report: dict) -> str:
    deadline = "no overall deadline" if report["deadline"] is None else f"deadline {report['deadline']:.0f} s"
    lines = [f"# GPU proof: {report['device']}", "",
             f"{report['started']}, mode {report['mode']}, {report['seconds']:.0f} s in all ({deadline}); command "
             f"`{report['command']}`.", "",
             "Every check compares with an independent reference (plain bitsandbytes, the kernels' pure-torch "
             "reference, the CPU's continuation); the speed and memory tables are measurements, not claims.", ""]
    lines += markdown_table(["part", "what", "verdict", "seconds"],
                            [[p["part"], p["title"], verdict(p), p.get("seconds") or "-"] for p in report["parts"]])
    if report.get("builds"):
        builds = report["builds"]
        lines += ["", f"Built up front, before any part's deadline: {', '.join(builds['ops'])} in "
                  f"{builds['seconds']} s (exit {builds['exit']}; what each took: proof.log)."]
    if report.get("install"):
        lines += ["", "## Installed from the bundle", ""]
        lines += [f"- {name}: {why}" for name, why in report["install"].get("installed", {}).items()]
        lines += [f"- {name}: skipped, {why}" for name, why in report["install"].get("skipped", {}).items()]
    for part in report["parts"]:
        lines += ["", f"## {part['part']}: {part['title']} ({verdict(part)})", ""]
        if part["checks"]:
            lines += markdown_table(["", "check", "measured", "bar"],
                                    [["ok" if c["ok"] else "**FAIL**", c["name"], c["measured"], c["bar"]]
                                     for c in part["checks"]])
        for table in part["tables"]:
            lines += ["", f"**{table['title']}**", ""] + markdown_table(table["columns"], table["rows"])
        if part["notes"]:
            lines += [""] + [f"- {note}" for note in part["notes"]]
        if part["error"]:
            lines += ["", "```", part["error"].strip()[-3000:], "```"]
    return "\n".join(lines) + "\n"

"""Rewrite the tables of times in tests/README.md from the suite's own JUnit XML.

    PIPEFLOW_TEST_TIMES=/tmp/times bash tests/run_all.sh   # each job writes DIR/JOB.xml
    python tests/timings.py /tmp/times                      # rewrites the tables
    python tests/timings.py --run                           # both (`make timings`)

Jobs are named by `run_all.sh`: `serial`, `n2-FILE`, `n4-FILE`, `strict-n2-FILE`, ...
A file's time in a column is the sum of its tests' times (set-up, call and tear-down) in
that kind of job; collection and start-up are the job's, not a file's. A cell that the
given XML does not cover keeps the table's previous figure, so one job rerun (one file's
XML) updates its own cells only. The second table is each job's pytest session (collection
included, the interpreter's start before it not), with the machine's load average when it
ended (`run_all.sh` notes it in DIR/load.txt), so a figure taken on a busy machine says so.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "tests" / "README.md"
START, END = "<!-- timings: start -->", "<!-- timings: end -->"
JOBS_START, JOBS_END = "<!-- job times: start -->", "<!-- job times: end -->"
COLUMNS = ("serial", "-n 2", "-n 4", "strict")
Times = dict[str, dict[str, float]]          # file -> column -> seconds


def column_of(job: str) -> str:
    """The table's column for a job's XML name (`serial`, `n2-...`, `strict-n4-...`)."""
    if job == "serial":
        return "serial"
    if job.startswith("strict-"):
        return "strict"
    match = re.match(r"n(\d+)-", job)
    if not match:
        raise SystemExit(f"timings: cannot tell the job of {job}.xml: expected serial.xml, "
                         f"nN-FILE.xml or strict-nN-FILE.xml (tests/run_all.sh's names)")
    return f"-n {match.group(1)}"


def file_of(classname: str) -> str:
    """`tests.test_engine_mpi.TestX` -> `test_engine_mpi.py`."""
    for part in classname.split("."):
        if part.startswith("test_"):
            return f"{part}.py"
    return classname


def read_times(folder: pathlib.Path) -> Times:
    """Seconds per test file and column, summed over the XML files in `folder`."""
    times: Times = collections.defaultdict(lambda: collections.defaultdict(float))
    xmls = sorted(folder.glob("*.xml"))
    if not xmls:
        raise SystemExit(f"timings: no JUnit XML in {folder}: run "
                         f"`PIPEFLOW_TEST_TIMES={folder} bash tests/run_all.sh` first")
    for xml in xmls:
        column = column_of(xml.stem)
        for case in ET.parse(xml).getroot().iter("testcase"):
            times[file_of(case.get("classname", ""))][column] += float(case.get("time", 0))
    return times


def old_table(text: str) -> Times:
    """The figures the README's table holds now, to keep where no XML says otherwise."""
    old: Times = {}
    if START not in text:
        return old
    for line in text.split(START, 1)[1].split(END, 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(COLUMNS) + 1 and cells[0].startswith("`test_"):
            old[cells[0].strip("`")] = {c: float(v) for c, v in zip(COLUMNS, cells[1:])
                                        if re.fullmatch(r"[\d.]+", v)}
    return old


def table(times: Times, old: Times, files: list[str]) -> str:
    """The markdown table: every test file, its seconds per column, the totals."""
    rows = ["| file | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    totals = dict.fromkeys(COLUMNS, 0.0)
    for name in files:
        cells = []
        for column in COLUMNS:
            seconds = times.get(name, {}).get(column, old.get(name, {}).get(column))
            cells.append("" if seconds is None else f"{seconds:.1f}")
            totals[column] += seconds or 0.0
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    rows.append("| all | " + " | ".join(f"{totals[c]:.0f}" for c in COLUMNS) + " |")
    return "\n".join(rows)


def job_table(folder: pathlib.Path) -> str:
    """One row a job: its tests, its pytest session's seconds, when it began, the load."""
    loads = {}
    if (folder / "load.txt").exists():
        for line in (folder / "load.txt").read_text().splitlines():
            job, _, load = line.partition(" ")
            loads[job] = load.strip()
    rows = ["| job | tests | seconds | began (UTC) | load average at its end (1, 5, 15 min) |",
            "|---|---:|---:|---|---|"]
    total = 0.0
    suites = [(xml.stem, next(ET.parse(xml).getroot().iter("testsuite")))
              for xml in folder.glob("*.xml")]
    for stem, suite in sorted(suites, key=lambda s: s[1].get("timestamp", "")):   # run order
        seconds = float(suite.get("time", 0))
        total += seconds
        began = suite.get("timestamp", "")[:19].replace("T", " ")
        rows.append(f"| `{stem}` | {suite.get('tests')} | {seconds:.0f} | {began} | "
                    f"{loads.get(stem, '')} |")
    rows.append(f"| all | | {total:.0f} | | |")
    return "\n".join(rows)


def _replace(text: str, start: str, end: str, new: str, readme: pathlib.Path) -> str:
    if start not in text or end not in text:
        raise SystemExit(f"timings: {readme} has no {start} ... {end} block to rewrite")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{new}\n{end}{rest.split(end, 1)[1]}"


def rewrite(folder: pathlib.Path, readme: pathlib.Path = README) -> str:
    """Replace the tables between the README's markers; returns the new tables. The job
    table is rewritten only from a folder with every part's XML (a rerun of one job would
    leave a table of one row)."""
    text = readme.read_text()
    files = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    new = table(read_times(folder), old_table(text), files)
    text = _replace(text, START, END, new, readme)
    columns = {column_of(x.stem) for x in folder.glob("*.xml")}
    if columns == set(COLUMNS):
        jobs = job_table(folder)
        text = _replace(text, JOBS_START, JOBS_END, jobs, readme)
        new += "\n\n" + jobs
    readme.write_text(text)
    return new


def longest_first(readme: pathlib.Path = README) -> list[str]:
    """Every test file, those the table has no serial figure for first, then the longest
    serial ones: run_all.sh hands its serial files to pytest-xdist in this order, so that
    the two workers do not end on one long file (longest processing time first)."""
    old = old_table(readme.read_text())
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    names = [p.relative_to(ROOT).as_posix() for p in files]
    return sorted(names, key=lambda n: -old.get(pathlib.Path(n).name, {}).get("serial", 1e9))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", help="JUnit XML written by run_all.sh")
    parser.add_argument("--run", action="store_true",
                        help="run tests/run_all.sh first, its XML into a fresh folder")
    parser.add_argument("--longest-first", action="store_true",
                        help="print the test files, longest serial ones first, and stop")
    args = parser.parse_args(argv)
    if args.longest_first:
        print("\n".join(longest_first()))
        return 0
    if args.run == bool(args.folder):
        parser.error("give a folder of JUnit XML, or --run (not both)")
    if args.run:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="pipeflow-times."))
        env = {**os.environ, "PIPEFLOW_TEST_TIMES": str(folder)}
        subprocess.run(["bash", str(ROOT / "tests" / "run_all.sh")], env=env, check=True)
    else:
        folder = pathlib.Path(args.folder)
    print(rewrite(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())

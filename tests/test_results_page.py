"""The results page (benchmarks/page.py, written by `python -m benchmarks --page`) rendered from a
small synthetic results structure, nothing timed: its length, every headline row, the GPU column,
a reason on every row where masked is slower, the plots linked; and the README's excerpt, which
the same command writes, agrees with the page it links."""
import importlib
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if not (ROOT / "benchmarks" / "page.py").exists():
    pytest.skip("needs the source tree's benchmarks/", allow_module_level=True)

# The tests run from outside the source tree (scripts/test.sh): its root goes on the path only to
# import benchmarks/, after the installed maskedbranch was imported.
sys.path.insert(0, str(ROOT))
try:
    page = importlib.import_module("benchmarks.page")
finally:
    sys.path.remove(str(ROOT))
PLOTS = [name for name, _ in page.PLOTS]
# a table cell for each pattern a headline row matches (the suites' sizes vary: --smoke runs smaller)
CELLS = {page.HETERO: "conv 3 x 4 BN, kernels 3/5/7/3 (conds)"}


def cell(value):
    return CELLS.get(value, value)


def synthetic(device="cpu", ratio=lambda i: 0.6 + 0.07 * i, skip=()):
    """results.json's structure with one table per (suite, title) the headline reads; ratios
    from ``ratio(row index)`` (some above 1), rows of ``skip`` left out."""
    tables = {}
    for i, spec in enumerate(page.HEADLINE):
        if i in skip:
            continue
        key = (spec.suite, spec.title)
        t = tables.setdefault(key, {"suite": spec.suite, "title": spec.title + " (sizes here)", "columns": [],
                                    "rows": [], "notes": ""})
        cols = [c for c, _ in spec.match] + [spec.column] + ([spec.ideal] if spec.ideal else [])
        for c in cols:
            if c not in t["columns"]:
                t["columns"].append(c)
                for r in t["rows"]:  # rows made before the column came
                    r.append("-")
        row = next((r for r in t["rows"] if all(r[t["columns"].index(c)] == cell(v) for c, v in spec.match)), None)
        if row is None:
            row = ["-"] * len(t["columns"])
            for c, v in spec.match:
                row[t["columns"].index(c)] = cell(v)
            t["rows"].append(row)
        row[t["columns"].index(spec.column)] = ratio(i)
        if spec.ideal:
            row[t["columns"].index(spec.ideal)] = 0.5
    return {"date": "2026-01-01 00:00 UTC", "machine": "Some CPU, 2 cores, load average 0.1", "torch": "2.14.1",
            "maskedbranch": "0.2.0", "python": "3.11.7", "command": "python -m benchmarks --page", "device": device,
            "size": "quick", "threads": [2], "notes": [], "tables": list(tables.values()),
            "checks": [{"check": "a == b", "max abs diff": 0.0, "tolerance": 0.0, "ok": True}]}


def test_a_row_matches_its_model_at_every_size():
    for layers in (3, 6, 12):
        assert page._matches(f"conv {layers} x 4 BN, kernels 3/5/7/3 (conds)", page.HETERO)
    assert not page._matches("conv 6 x 4 BN (stacked)", page.HETERO)
    assert not page._matches(None, page.HETERO)


def headline_rows(text):
    """The headline table's data rows (cells), without the group headings."""
    body = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines() if line.startswith("| ")]
    return [r for r in rows[1:] if not r[0].startswith("**")]


def test_page_is_short_and_has_every_headline_row():
    text = page.render(synthetic(), PLOTS, wall_s=600)
    assert text.count("\n") <= page.MAX_LINES
    rows = headline_rows(text)
    assert len(rows) == len(page.HEADLINE)
    for spec, cells in zip(page.HEADLINE, rows):
        assert cells[0] == spec.choice and cells[1].startswith(spec.against.format(ideal="").strip())


def test_header_names_date_torch_machine_device_and_command():
    head = page.render(synthetic(), PLOTS).split("## Headline")[0]
    for needle in ("2026-01-01 00:00 UTC", "torch 2.14.1", "Some CPU, 2 cores", "CPU", "`python -m benchmarks --page`"):
        assert needle in head


def test_gpu_column_says_not_measured_and_cpu_has_the_ratios():
    rows = headline_rows(page.render(synthetic(), PLOTS))
    assert all(r[3] == "not measured" for r in rows)
    assert all(re.fullmatch(r"\d+\.\d\d", r[2]) for r in rows)


def test_every_row_where_masked_is_slower_says_why():
    rows = headline_rows(page.render(synthetic(), PLOTS))
    slower = [r for r in rows if float(r[2]) > 1.0]
    assert slower and len(slower) < len(rows)  # both kinds present
    for r in rows:
        if float(r[2]) > 1.0:
            assert r[4].endswith(".") and len(r[4].split()) >= 6, r
        else:
            assert r[4] == "", r


def test_a_slower_row_within_the_spread_says_so():
    text = page.render(synthetic(ratio=lambda i: 1.02), PLOTS)
    assert all("within the run-to-run spread" in r[4] for r in headline_rows(text))


def test_rows_not_measured_say_so_in_both_columns():
    text = page.render(synthetic(skip={0, 5}), PLOTS)
    rows = headline_rows(text)
    for i in (0, 5):
        assert rows[i][2] == rows[i][3] == "not measured" and rows[i][4] == ""
    assert page.missing(synthetic(skip={0})) == [page.HEADLINE[0].short]


def test_a_gpu_run_fills_the_gpu_column():
    rows = headline_rows(page.render(synthetic(device="cuda"), PLOTS))
    assert all(r[2] == "not measured" and re.fullmatch(r"\d+\.\d\d", r[3]) for r in rows)


def test_plots_are_linked_and_only_those_written():
    text = page.render(synthetic(), PLOTS)
    for name in PLOTS:
        assert f"](plots/{name})" in text
    assert "](plots/kernels.png)" not in page.render(synthetic(), ["headline.png"])


def test_no_history_first_person_or_issue_numbers():
    text = page.render(synthetic(), PLOTS)
    assert not re.search(r"\b(I|we|We|my|our|us)\b", text)
    assert not re.search(r"[Ii]ssue \d+|#\d+", text)


def test_readme_excerpt_is_replaced_between_its_markers():
    block = page.readme_block(synthetic(), "benchmarks/RESULTS.md", "benchmarks/plots/headline.png")
    assert block.startswith(page.BEGIN) and block.endswith(page.END)
    assert "](benchmarks/plots/headline.png)" in block
    text = "before\n" + page.BEGIN + " old -->\nold rows\n" + page.END + "\nafter\n"
    new = page.replace_block(text, block)
    assert new.startswith("before\n") and new.endswith("\nafter\n") and "old rows" not in new
    assert page.replace_block("no markers", block) is None


def test_publish_writes_the_page_its_plots_and_the_readme_excerpt(tmp_path):
    pytest.importorskip("matplotlib")
    out, repo = tmp_path / "results", tmp_path / "repo"
    out.mkdir()
    (repo / "benchmarks").mkdir(parents=True)
    (out / "ddp.png").write_bytes(b"png")  # a plot the run wrote; kernels.png it did not
    readme = repo / "README.md"
    readme.write_text("# x\n\n## Performance\n\n" + page.BEGIN + " -->\n" + page.END + "\n\n## Next\n")
    written = page.publish(dict(synthetic(), wall_s=60.0), out, repo / "benchmarks", readme)
    text = written.read_text()
    assert (repo / "benchmarks" / "plots" / "headline.png").stat().st_size > 1000
    assert (repo / "benchmarks" / "plots" / "ddp.png").read_bytes() == b"png"
    assert "](plots/ddp.png)" in text and "kernels.png" not in text and "wall time 1 min" in text
    new = readme.read_text()
    assert new.startswith("# x\n") and new.endswith("## Next\n") and "](benchmarks/RESULTS.md)" in new
    rows = [line for line in new.splitlines() if line.startswith("| ") and not line.startswith("| Choice")]
    assert len(rows) == sum(spec.key for spec in page.HEADLINE) and all(line in text.splitlines() for line in rows)


def test_the_committed_readme_excerpt_matches_the_committed_page():
    """The command writes both from one run: every row of the README's excerpt is a row of the page."""
    readme = (ROOT / "README.md").read_text()
    start, end = readme.find(page.BEGIN), readme.find(page.END)
    assert 0 <= start < end, "README.md lost its results-page markers"
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    rows = [line for line in readme[start:end].splitlines() if line.startswith("| ") and not line.startswith("| Choice")]
    assert rows and all(line in results.splitlines() for line in rows)
    assert "(benchmarks/plots/headline.png)" in readme[start:end] and (ROOT / "benchmarks" / "plots" / "headline.png").exists()
    assert results.count("\n") <= page.MAX_LINES


def test_spread_between_launches_is_read_from_the_headline_rows():
    results = synthetic()
    ddp = next(t for t in results["tables"] if t["suite"] == "ddp")
    ddp["columns"].append("per launch*")
    for r in ddp["rows"]:
        r.append("1.02 / 1.15 / 1.1")
    assert "differed by up to 0.13 between the launches" in page.render(results, PLOTS)

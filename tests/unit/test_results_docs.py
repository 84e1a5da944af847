"""The docs' results are the files': one current file per bench, rendered, and docs a newcomer reads.

- the README's results table and docs/results.md are what ``scripts/render_results.py`` renders
  from ``docs/results/`` (a figure typed by hand, or a file changed without rendering, fails);
- ``docs/results/`` holds one current file per bench, each one the renderer reads or a bench
  writes beside it;
- a bench's ``--publish`` overwrites its one file, stamps it and renders the docs;
- the README stays short (250 lines, 3,000 words), measurements.md is the method (500 lines),
  and no doc says it is dated or names a commit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdd_sglang.dev import results

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Written by a bench beside its result, not rendered: the soak's per-request detail, the router's
# py-spy profile, the frontier's figure.
BESIDE = {"soak_detail.json", "router_profile.json", "frontier.png"}


def test_the_rendered_blocks_agree_with_the_files():
    stale = results.render(write=False)
    assert not stale, f"{stale}: run scripts/render_results.py"


def test_every_results_file_is_a_current_result():
    names = {p.name for p in results.RESULTS.iterdir()}
    rendered = {name for name, _ in results.BUILDERS}
    assert len(names) <= 15, sorted(names)
    assert names <= rendered | BESIDE, f"not rendered, not a bench's: {sorted(names - rendered - BESIDE)}"
    assert {a.file for a in results.areas()} == names & rendered


def test_each_area_says_what_ran_on_what_the_goal_and_the_date():
    for area in results.areas():
        for cell in (area.ran, area.on, area.figure, area.goal):
            assert cell and "|" not in cell, (area.name, cell)
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", area.date), (area.name, area.date)


def test_publish_overwrites_the_one_file_stamps_it_and_renders(tmp_path, monkeypatch):
    readme, page, folder = tmp_path / "README.md", tmp_path / "results.md", tmp_path / "results"
    folder.mkdir()
    for doc in (readme, page):
        doc.write_text(f"before\n{results.BEGIN}\nstale\n{results.END}\nafter\n")
    monkeypatch.setattr(results, "RESULTS", folder)
    monkeypatch.setattr(results, "README", readme)
    monkeypatch.setattr(results, "PAGE", page)
    monkeypatch.setattr(results, "REPO", tmp_path)
    report = json.loads((ROOT / "docs" / "results" / "tp_matrix.json").read_text())
    report.pop("run", None)
    report["results"][0]["result"] = "FAIL"
    results.publish("tp_matrix", report)
    written = json.loads((folder / "tp_matrix.json").read_text())
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", written["run"]["date"])
    assert "cores" in written["run"]["machine"]
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "stale" not in text
    assert "**missed**: " + report["results"][0]["combination"] in text
    assert "## Mixed TP" in page.read_text()
    assert results.render(write=False) == []
    report["results"][0]["result"] = "PASS"
    results.publish("tp_matrix", report)
    assert "**met**" in readme.read_text() and sorted(p.name for p in folder.iterdir()) == [
        "tp_matrix.json"]


def test_a_run_the_docs_cannot_render_is_not_published(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    folder.mkdir()
    monkeypatch.setattr(results, "RESULTS", folder)
    monkeypatch.setattr(results, "REPO", tmp_path)
    current = (ROOT / "docs" / "results" / "router_bench.json").read_bytes()
    (folder / "router_bench.json").write_bytes(current)
    quick = json.loads(current)
    quick["runs"] = [run for run in quick["runs"] if run["concurrency"] != 256]
    with pytest.raises(ValueError, match="not published"):
        results.publish("router_bench", quick)
    assert (folder / "router_bench.json").read_bytes() == current
    with pytest.raises(ValueError, match="not published"):
        results.publish("tp_matrix", {"results": []})
    assert not (folder / "tp_matrix.json").exists()


def test_a_doc_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="markers"):
        results.replace_block("no markers\n", "x", results.README)


def test_the_readme_is_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert len(text.split()) <= 3000, len(text.split())


def test_measurements_is_the_method():
    assert len((ROOT / "docs" / "measurements.md").read_text().splitlines()) <= 500


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_doc_is_dated_or_names_a_commit(path):
    text = path.read_text()
    assert not re.search(r"\bDated\b|as of commit|at commit", text), path.name
    # A commit's short hash: 7-12 hex digits with a digit and a letter among them.
    hashes = re.findall(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b", text)
    assert not hashes, f"{path.name} names commits: {sorted(set(hashes))[:5]}"

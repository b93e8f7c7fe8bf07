"""HTML / Markdown reports: valid HTML holding the stage and certificate tables."""

import json
from html.parser import HTMLParser

import numpy as np
import pytest

from fxpipe.cli import main
from fxpipe.errors import InputError
from fxpipe.ir import OpGraph
from fxpipe.partition.bounds import compute_bounds
from fxpipe.report import ReportSection, stage_table, write_report


class _Checker(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.tables, self.cells, self.imgs = [], 0, [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables += 1
        if tag == "img":
            self.imgs += 1
            assert dict(attrs)["src"].startswith("data:image/png;base64,")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] in ("td", "th"):
            self.cells.append(data)


def _graph():
    rng = np.random.default_rng(1)
    n = 9
    edges = [(i, i + 1) for i in range(n - 1)] + [(1, 5)]
    return OpGraph.from_arrays(t_fwd_s=rng.uniform(1, 2, n), size_out_bytes=rng.uniform(0, 1, n), edges=edges, name="g<9>",
                               ops=["placeholder"] + ["call_function"] * (n - 2) + ["output"])


def check_html(text):
    p = _Checker()
    p.feed(text)
    p.close()
    assert p.stack == [], f"unclosed tags {p.stack}"
    return p


def test_write_report_html_and_markdown(tmp_path):
    g = _graph()
    rep = compute_bounds(g, 3, methods=("simple", "bottleneck", "exact"), time_limit_s=10, search_time_limit_s=0.2)
    sec = ReportSection(title="Schedule", markdown="makespan 1.0 s", html="<p>makespan <b>1.0</b> s</p>")
    out = write_report(g, rep.partition, rep, tmp_path / "r.html", tmp_path / "r.md", command="fxpipe report g.json -k 3 -o r.html",
                       extra_sections=[sec])
    text = out["html"].read_text()
    p = check_html(text)
    assert p.tables >= 4 and p.imgs == 2
    assert "exact" in p.cells and "simple" in p.cells
    assert "g&lt;9&gt;" in text  # escaped
    rows = stage_table(g, rep.partition)
    assert len(rows) == 3 and sum(r["ops"] for r in rows) == g.n
    assert max(r["cost_s"] for r in rows) == pytest.approx(rep.partition.bottleneck)
    assert "fxpipe report g.json -k 3 -o r.html" in text and "makespan <b>1.0</b>" in text
    md = out["markdown"].read_text()
    assert "| method |" in md and "## Reproduce" in md and "makespan 1.0 s" in md


def test_write_report_needs_an_output_and_real_sections(tmp_path):
    g = _graph()
    with pytest.raises(InputError):
        write_report(g, None, None)
    with pytest.raises(InputError):
        write_report(g, None, None, tmp_path / "x.html", extra_sections=[("t", "body")])


def test_report_cli(tmp_path, capsys):
    path = str(_graph().save(tmp_path / "g.json"))
    out_html, out_md = tmp_path / "r.html", tmp_path / "r.md"
    rc = main(["report", path, "-k", "2", "-o", str(out_html), "--markdown", str(out_md), "--methods", "simple,exact",
               "--time-limit", "5", "--search-time-limit", "0.2", "--no-charts", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"]["html"] == str(out_html)
    text = out_html.read_text()
    p = check_html(text)
    assert "exact" in p.cells and p.imgs == 0
    assert f"fxpipe report {path} --format auto -k 2" in text and "--no-charts" in text
    assert out_md.exists()

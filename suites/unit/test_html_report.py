"""The HTML reports (kvgate.harness.report.html) rendered in a real headless browser (Chromium's headless
shell): the page loads, every plot the report promises is in the rendered DOM as an SVG
with marks in it, and the screenshot is not blank. The check itself is tested on a page
whose plots are missing: it must say so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from kvgate.harness.report.html import bench_report, gate_report, plan_report

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def browser():
    if BROWSER is None:
        if os.environ.get("CI"):
            pytest.fail("no headless Chromium: `make servers` installs chromium-headless-shell")
        pytest.skip("no headless Chromium (make servers installs chromium-headless-shell)")
    return BROWSER


def _run(browser: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, timeout=120)


class _Plots(HTMLParser):
    """Each <figure class="plot">'s id, and how many drawing elements its <svg> holds."""

    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, int] = {}
        self._in: str | None = None
        self._svg = False

    def handle_starttag(self, tag, attrs):  # noqa: ANN001, ANN201
        a = dict(attrs)
        if tag == "figure" and "plot" in (a.get("class") or ""):
            self._in = a.get("id")
            self.plots[self._in] = -1  # no svg yet
        elif tag == "svg" and self._in is not None:
            self._svg = True
            self.plots[self._in] = 0
        elif self._svg and tag in ("path", "use", "rect", "text", "polyline", "line", "circle"):
            self.plots[self._in] += 1

    def handle_endtag(self, tag):  # noqa: ANN001, ANN201
        if tag == "svg":
            self._svg = False
        elif tag == "figure":
            self._in = None


def rendered_plots(browser: str, page: Path) -> dict[str, int]:
    out = _run(browser, "--dump-dom", page.as_uri())
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    parser = _Plots()
    parser.feed(out.stdout.decode())
    return parser.plots


def screenshot_ink(browser: str, page: Path, tmp: Path) -> float:
    """The share of the screenshot's pixels that are not background white."""
    import matplotlib.image

    png = tmp / f"{page.stem}.png"
    out = _run(browser, f"--screenshot={png}", "--window-size=1200,1800", page.as_uri())
    assert out.returncode == 0 and png.exists(), out.stderr.decode()[-2000:]
    img = matplotlib.image.imread(png)[..., :3]
    return float((img.min(axis=2) < 0.9).mean())


def check(browser: str, page: Path, tmp: Path, expected: list[str]) -> list[str]:
    """What is wrong with the rendered page: a promised plot missing, one without an SVG or
    with too few marks to be a plot, a blank screenshot."""
    plots = rendered_plots(browser, page)
    problems = [f"plot {name} missing" for name in expected if name not in plots]
    problems += [f"plot {name} has no svg" for name, n in plots.items() if n < 0]
    problems += [f"plot {name} has {n} marks" for name, n in plots.items() if 0 <= n < 10]
    if screenshot_ink(browser, page, tmp) < 0.01:
        problems.append("the screenshot is blank")
    return problems


def _measured(seed: int = 7) -> dict:
    rng = np.random.default_rng(seed)
    samples, misses, timeline = [], [], []
    t = 1000.0
    for i in range(120):
        kind = ("cold", "local", "remote", "tier", "fallback")[i % 5]
        L = (1024, 2048, 4096, 8192)[i % 4]
        base = {"cold": L * 0.1, "local": 30, "remote": 40 + L * 0.005, "tier": 50 + L * 0.01, "fallback": L * 0.15}
        samples.append({"t": t, "system": "default", "replica": "AB"[i % 2], "tag": f"r{i}", "prompt_tokens": L,
                        "kind": kind, "hit_tokens": 0, "ttft_ms": float(base[kind] * rng.uniform(0.8, 1.5)),
                        "miss_cause": None})
        if kind in ("cold", "fallback"):
            misses.append({"t": t, "ev": "lookup", "replica": "A",
                           "cause": ("never_published", "evicted", "corrupt")[i % 3]})
        if i % 17 == 0:
            timeline.append({"t": t, "what": "fault", "kind": ("corrupt", "timeout")[i % 2], "site": "pool_client",
                             "replica": "B"})
        t += 2.5
    return {"provenance": {"short": "abc", "clean": True}, "systems": [
        {"system": "default", "geometry": {"bytes_per_token": 1024, "block_size": 128}, "samples": samples,
         "timeline": timeline, "misses": misses}]}


RUN = {"passed": True, "replay_key": {"seed": 1}, "summary": {"passed": 2, "criteria": 2, "wall_s": 10},
       "criteria": [{"name": "a", "result": "pass", "reason": "ok", "replay": "kvgate replay a --seed 1"},
                    {"name": "b", "result": "pass", "reason": "ok", "replay": "kvgate replay b --seed 1"}]}
GATE_PLOTS = ["plot-ttft-by-kind-default", "plot-payback-default", "plot-miss-causes-default",
              "plot-fault-timeline-default"]


def test_a_gate_report_renders_with_its_four_plots(browser, tmp_path):
    page = tmp_path / "gate.html"
    page.write_text(gate_report(RUN, _measured()))
    assert check(browser, page, tmp_path, GATE_PLOTS) == []


def test_control_a_page_without_its_plots_is_caught(browser, tmp_path):
    """The check's own negative control: the same report with its SVGs cut out, and one
    whose plots were never written."""
    text = gate_report(RUN, _measured())
    cut = tmp_path / "cut.html"
    import re

    cut.write_text(re.sub(r"<svg.*?</svg>", "", text, flags=re.S))
    problems = check(browser, cut, tmp_path, GATE_PLOTS)
    assert {f"plot {n} has no svg" for n in GATE_PLOTS} <= set(problems), problems
    bare = tmp_path / "bare.html"
    bare.write_text("<!DOCTYPE html><html><body></body></html>")
    problems = check(browser, bare, tmp_path, GATE_PLOTS)
    assert {f"plot {n} missing" for n in GATE_PLOTS} <= set(problems) and "the screenshot is blank" in problems


def test_the_committed_bench_reports_and_a_plan_render(browser, tmp_path):
    from kvgate.harness.plan import DEFAULT_MIX, load_measured, load_mix, plan

    bench = REPO / "reports" / "bench"
    hosts = sorted(bench.glob("*-hosts.json"))[-1]
    pool = sorted(bench.glob("*-pool.json"))[-1]
    for src, plots in ((hosts, ["plot-payback", "plot-faults"]), (pool, ["plot-pool-throughput"])):
        page = tmp_path / f"{src.stem}.html"
        page.write_text(bench_report(json.loads(src.read_text()), src.stem))
        assert check(browser, page, tmp_path, plots) == [], src
    doc = plan(load_measured([hosts]), load_mix(DEFAULT_MIX))
    page = tmp_path / "plan.html"
    page.write_text(plan_report(doc))
    assert check(browser, page, tmp_path, ["plot-plan-benefit"]) == []

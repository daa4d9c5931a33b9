"""The HTML pipesim writes, opened in a real browser.

Headless Chromium (Debian's ``chromium``, which ``.ci/run`` installs where it
can) driven by Playwright loads each page pipesim writes (a simulation's
timeline, a comparison, a validation overlay, a reproduction's figure) from
disk, with no network, and fails on a JavaScript error, on a plot with no
drawn marks, or on a timeline whose device rows differ from the run's
devices. Where no browser exists the tests are skipped with that reason
(``pytest -rs`` prints it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipesim.experiments.export import find_browser

pytestmark = pytest.mark.slow

BROWSER = find_browser()
if BROWSER is None:
    pytest.skip(
        "no Chromium or Chrome on this machine: the HTML is not opened in a browser (apt-get install chromium)",
        allow_module_level=True,
    )
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
)

#: What a page must satisfy once plotly has drawn it, read in the page itself.
PLOT_STATE = """() => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  return plots.map(p => ({
    traces: (p.data || []).length,
    // drawn marks only: plotly keeps a zero-width bar for a value it cannot draw (a NaN)
    marks: [...p.querySelectorAll('.barlayer .point path')]
        .filter(el => { const b = el.getBBox(); return b.width > 0 && b.height > 0; }).length
      + [...p.querySelectorAll('.scatterlayer path.js-line, .scatterlayer .point')]
        .filter(el => { const b = el.getBBox(); return b.width > 0 || b.height > 0; }).length,
    yticks: [...p.querySelectorAll('.ytick text')].map(t => t.textContent),
  }));
}"""


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=BROWSER,
            headless=True,
            # this machine's network is closed: no background connections that would be refused
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield chromium
        chromium.close()


def open_page(browser, path: Path) -> list[dict]:
    """Load ``path``, wait for plotly, and return each plot's state; fail on a script error."""
    assert path.is_file(), f"{path} was not written"
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.route("http*://**", lambda route: route.abort())  # a self-contained page needs nothing from outside
    try:
        page.goto(path.resolve().as_uri())
        page.wait_for_function(
            "() => document.querySelectorAll('.js-plotly-plot .main-svg').length > 0", timeout=30_000
        )
        state = page.evaluate(PLOT_STATE)
    except playwright_api.Error as e:
        raise AssertionError(f"{path.name} did not draw: {e}; " + "; ".join(errors)) from None
    finally:
        page.close()
    assert not errors, f"{path.name}: " + "; ".join(errors)
    assert state, f"{path.name} draws no plot"
    for plot in state:
        assert plot["traces"] > 0 and plot["marks"] > 0, f"{path.name} has an empty plot: {plot}"
    return state


def device_rows(plot: dict) -> list[str]:
    """The timeline's device rows (each device's compute row, not its comm row)."""
    return [t for t in plot["yticks"] if t.startswith("device") and "comm" not in t]


def pipesim_cli(*args: str) -> None:
    from pipesim.experiments.cli import main

    assert main(list(args)) == 0


def test_a_simulation_timeline_has_one_row_per_device(browser, tmp_path) -> None:
    pipesim_cli("simulate", "--strategy", "1f1b", "--stages", "4", "--microbatches", "8", "--out", str(tmp_path))
    (plot,) = open_page(browser, tmp_path / "timeline.html")
    assert len(device_rows(plot)) == 4, plot["yticks"]


def test_a_wide_pipeline_timeline_counts_every_replica(browser, tmp_path) -> None:
    # two pipelines of three stages side by side: six devices, not three
    pipesim_cli(
        "simulate",
        "--strategy",
        "pipedream-2bw",
        "--stages",
        "3",
        "--microbatches",
        "3",
        "--width",
        "2",
        "--out",
        str(tmp_path),
    )
    (plot,) = open_page(browser, tmp_path / "timeline.html")
    assert len(device_rows(plot)) == 6, plot["yticks"]


def test_a_comparison_and_its_timelines_render(browser, tmp_path) -> None:
    pipesim_cli(
        "compare",
        "--strategies",
        "gpipe,zb-h1",
        "--model",
        "uniform",
        "--stages",
        "3",
        "--microbatches",
        "4",
        "--iterations",
        "1",
        "--out",
        str(tmp_path),
    )
    open_page(browser, tmp_path / "comparison.html")
    for strategy in ("gpipe", "zb-h1"):
        (plot,) = open_page(browser, tmp_path / strategy / "timeline.html")
        assert len(device_rows(plot)) == 3, plot["yticks"]


def test_a_validation_overlay_renders(browser, tmp_path) -> None:
    from pipesim.experiments.overlay import write_overlay_html
    from pipesim.sim.api import simulate
    from pipesim.sim.engine.results import SimResult, Span
    from pipesim.sim.strategies import ScheduleSpec

    predicted = simulate(ScheduleSpec(strategy="1f1b", stages=2, microbatches=4), "uniform", "ideal")
    measured = SimResult(
        schedule=predicted.schedule,
        memory=[],
        versions=[],
        max_versions_held={},
        link_bytes={},
        spans=[
            Span(s.device, s.stream, s.action, s.start * 1.1, s.end * 1.1, s.peer, s.flow, s.nbytes)
            for s in predicted.spans
        ],
    )
    write_overlay_html(measured, predicted, tmp_path / "overlay.html")
    (plot,) = open_page(browser, tmp_path / "overlay.html")
    # each device twice, measured above simulated
    assert plot["yticks"] == ["d0 measured", "d0 simulated", "d1 measured", "d1 simulated"], plot["yticks"]


def test_a_reproduction_figure_renders(browser, tmp_path) -> None:
    pipesim_cli("reproduce", "pipedream", "--out", str(tmp_path))
    open_page(browser, tmp_path / "pipedream" / "table1.html")


def test_the_checks_catch_a_script_error_and_an_empty_plot(browser, tmp_path) -> None:
    # the checks above are not vacuous: a broken page and an empty figure fail them
    pipesim_cli("simulate", "--strategy", "gpipe", "--stages", "2", "--microbatches", "2", "--out", str(tmp_path))
    html = (tmp_path / "timeline.html").read_text(encoding="utf-8")
    broken = tmp_path / "broken.html"
    broken.write_text(html.replace("</body>", "<script>no_such_function();</script></body>"), encoding="utf-8")
    with pytest.raises(AssertionError, match="no_such_function"):
        open_page(browser, broken)
    import plotly.graph_objects as go

    empty = tmp_path / "empty.html"
    go.Figure().write_html(empty, include_plotlyjs=True)
    with pytest.raises(AssertionError, match="empty plot"):
        open_page(browser, empty)
    undrawn = tmp_path / "undrawn.html"  # traces, but every bar NaN: nothing drawn
    go.Figure(go.Bar(x=[float("nan")] * 3, y=["a", "b", "c"], orientation="h")).write_html(
        undrawn, include_plotlyjs=True
    )
    with pytest.raises(AssertionError, match="empty plot"):
        open_page(browser, undrawn)

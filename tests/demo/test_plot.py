"""``accuracy_vs_budget.png``: every policy labelled in a legend that lies inside the saved image, no two
policies of one colour."""
from __future__ import annotations

import json
from pathlib import Path

import kvpop.evaluation.evaluate as E

SHIPPED = Path(E.__file__).resolve().parents[1] / "data" / "demo_results"


def _drawn(results, monkeypatch, tmp_path):
    figs = []
    real = E.save_figure

    def keep(fig, path, **kw):
        fig.canvas.draw()
        figs.append((fig, fig.get_tightbbox(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans), kw))
        real(fig, path, **kw)

    monkeypatch.setattr(E, "save_figure", keep)
    E.plot_results(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    return figs[0]


def test_every_policy_has_a_visible_label_and_its_own_colour(monkeypatch, tmp_path):
    for task in ("kvtrace", "lookahead"):
        results = json.loads((SHIPPED / task / "results.json").read_text())
        fig, tight, kw = _drawn(results, monkeypatch, tmp_path)
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels == sorted({r["policy"] for r in results["rows"]}, key=E.row_order), task
        # saved with the tight box: the legend's box lies inside the image
        assert kw.get("bbox_inches") == "tight"
        box = legend.get_window_extent()
        assert tight.x0 <= box.x0 and box.x1 <= tight.x1 + 1 and tight.y0 <= box.y0 and box.y1 <= tight.y1 + 1
        colours = [tuple(h.get_color()) if not isinstance(h.get_color(), str) else h.get_color()
                   for h in legend.legend_handles if h.get_label() != "dense"]
        assert len(set(colours)) == len(colours), (task, colours)

"""`lanes timeline --html`: the self-contained page, made where the console makes it too (in its incident bundle)."""

from __future__ import annotations

from lanes_console.timeline_page import LANE_ORDER, first_error, render_page

__all__ = ["LANE_ORDER", "first_error", "render_page"]

"""Viewers of a run directory: report.html with its SVG plots, report.png, and `meshforge top`."""

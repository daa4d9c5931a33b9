"""Shared test settings."""

import os

# PNG export starts a browser (seconds per figure); tests check the HTML and
# JSON, and test_timeline checks the PNG path with a stand-in exporter.
os.environ.setdefault("PIPESIM_PNG", "0")

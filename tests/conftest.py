"""Shared test settings."""

import os

import pytest

# PNG export starts a browser (seconds per figure); tests check the HTML and
# JSON, and test_timeline checks the PNG path with a stand-in exporter.
os.environ.setdefault("PIPESIM_PNG", "0")

#: Examples the fuzz tests draw in all by default: a few hundred, well under
#: 20 s. ``pytest --fuzz-examples N`` runs a longer campaign.
FUZZ_EXAMPLES = 300


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=FUZZ_EXAMPLES,
        metavar="N",
        help=f"examples the fuzz tests (tests/test_fuzz.py) draw in all (default {FUZZ_EXAMPLES})",
    )


@pytest.fixture
def fuzz_examples(request):
    """``share -> max_examples``: the slice of ``--fuzz-examples`` one fuzz test draws."""
    total = request.config.getoption("--fuzz-examples")
    return lambda share: max(1, round(total * share))

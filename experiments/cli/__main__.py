"""``python -m pipesim.experiments.cli``: the ``pipesim`` console script."""

from pipesim.experiments.cli import console_main

if __name__ == "__main__":
    console_main()

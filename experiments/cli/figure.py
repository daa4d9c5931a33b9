"""``pipesim figure``: paper-style figures (``bubbles``)."""

from __future__ import annotations

from pipesim.experiments.cli.common import output_dir


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("figure", help="paper-style figures")
    p.add_argument(
        "name",
        choices=("bubbles",),
        help="bubbles: the bubble fraction of every strategy against micro-batches, simulated beside the closed forms",
    )
    p.add_argument("--out", default="out/figures", help="output folder")
    p.set_defaults(func=run)


def run(args) -> int:
    from pipesim.experiments.figures import bubble_figure

    path = bubble_figure(output_dir(args.out))
    print(f"wrote {path} and {path.with_suffix('.json').name} (its data)")
    return 0

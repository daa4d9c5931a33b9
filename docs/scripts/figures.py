"""Write every image the documentation shows, from pipesim's own commands.

    python3 docs/scripts/figures.py [--out docs/images]

Each image is the PNG a pipesim command writes beside its HTML (PNG export
needs a Chrome or Chromium on the machine: ``apt-get install chromium``);
this script runs the commands in a temporary folder and copies the PNGs,
so a reader sees them without running anything. ``docs/images/README.md``
records the date, machine and commands of the last run.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: pipesim arguments -> {PNG the command writes (relative to its --out): image name}
FIGURES = [
    (
        [
            "simulate",
            "--strategy",
            "1f1b",
            "--model",
            "gpt-1.3b",
            "--hardware",
            "dgx1-v100",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--iterations",
            "2",
        ],
        {"timeline.png": "timeline.png"},
    ),
    (["compare"], {"comparison.png": "comparison.png"}),
    (
        [
            "plan",
            "--strategy",
            "pipedream",
            "--model",
            "pipedream-vgg16",
            "--hardware",
            "pipedream-cluster-a-x4",
            "--gpus",
            "16",
        ],
        {"pareto.png": "pareto.png"},
    ),
    (
        [
            "validate",
            "--strategy",
            "1f1b",
            "--stages",
            "2",
            "--model",
            "mlp",
            "--microbatch-size",
            "64",
            "--backend",
            "gloo",
        ],
        {"overlay.png": "overlay.png"},
    ),
    (["reproduce", "pipedream"], {"pipedream/table1.png": "pipedream-table1.png"}),
    (["reproduce", "2bw"], {"2bw/figure6.png": "2bw-figure6.png", "2bw/figure10.png": "2bw-figure10.png"}),
    (["reproduce", "spectrain"], {"spectrain/speedup.png": "spectrain-speedup.png"}),
    # several commands share one --out; "{out}" stands for it
    (
        [
            ["trace", "import", "tests/data/torch-pipelining-traces/1f1b", "--schedule", "1f1b", "--microbatches", "4"],
            ["trace", "reconcile", "{out}"],
            ["trace", "whatif", "{out}", "--strategies", "1f1b,interleaved-1f1b,zb-h1,pipedream-2bw"],
        ],
        {"overlay.png": "trace-overlay.png", "whatif.png": "trace-whatif.png"},
    ),
]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "images")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Images of the documentation",
        "",
        f"Written by `python3 docs/scripts/figures.py` on {datetime.date.today().isoformat()}, "
        f"on {cpu_name()} ({platform.system()} {platform.machine()}, Python {platform.python_version()}).",
        "",
        "| image | command |",
        "|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="pipesim-docs-") as tmp:
        for k, (command, images) in enumerate(FIGURES):
            out = Path(tmp) / str(k)
            commands = command if isinstance(command[0], list) else [command]
            for one in commands:
                argv = [str(out) if a == "{out}" else a for a in one]
                print(f"pipesim {' '.join(argv)}", file=sys.stderr, flush=True)
                subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        "from pipesim.experiments.cli import console_main; console_main()",
                        *argv,
                        "--out",
                        str(out),
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
            shown = " && ".join("pipesim " + " ".join("OUT" if a == "{out}" else a for a in one) for one in commands)
            for png, name in images.items():
                written = out / png
                if not written.is_file():
                    print(f"error: {written} was not written (is Chromium installed?)", file=sys.stderr)
                    return 1
                shutil.copyfile(written, args.out / name)
                lines.append(f"| `{name}` | `{shown}` |")
    (args.out / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

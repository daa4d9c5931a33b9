"""Profile files in and out: pipesim's JSON, or PipeDream's ``graph.txt``.

Reading sits above both formats (:mod:`pipesim.sim.workloads.profile` and
:mod:`pipesim.sim.workloads.pipedream_graph`) and tells them apart by
content and name.
"""

from __future__ import annotations

import json

from pipesim.sim.files import parse_json, read_text
from pipesim.sim.workloads.pipedream_graph import graph_file_profile, looks_like_graph
from pipesim.sim.workloads.profile import Profile, WorkloadError


def load_profile(path) -> Profile:
    """Read a profile file: pipesim's JSON, or PipeDream's graph.txt
    (:mod:`pipesim.sim.workloads.pipedream_graph`, told apart by content and name);
    :class:`WorkloadError` naming the file and the problem."""
    text = read_text(path, "profile", WorkloadError)
    graph = looks_like_graph(path, text)
    data = None if graph else parse_json(text, f"profile file {path}", WorkloadError)
    try:
        return graph_file_profile(path, text) if graph else Profile.from_json(data)
    except WorkloadError as e:
        raise WorkloadError(f"profile file {path}: {e}") from None


def save_profile(profile: Profile, path) -> None:
    """Write ``profile`` as JSON that :func:`load_profile` reads back unchanged."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")

"""The multi-process launcher and the communication profiler.

Worker functions live at module level: spawned workers import them by name.
Each multi-process test is one launch of two gloo ranks (about 1.5 s, mostly
the workers importing torch), so the file keeps the launches few.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import signal
import time

import pytest
import torch
import torch.distributed as dist

from pipesim.sim.hardware.machines import Hardware
from pipesim.validate import commprofile
from pipesim.validate import launch as launch_mod
from pipesim.validate.commprofile import (
    fit_latency_bandwidth,
    hardware_json,
    measure_p2p,
)
from pipesim.validate.launch import LaunchTimeout, WorkerError, launch

# --- worker functions (top level: spawn imports them by name) ---------------


def _collective(ctx, payload):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    # every rank creates every group, in the same order
    pair = ctx.new_group([0, 1])
    one = torch.ones(3)
    dist.all_reduce(one, group=pair)
    raw = commprofile._collective_worker(ctx, [1, 256], 2, 1, True)
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "threads": torch.get_num_threads(),
        "sum": t.item(),
        "group_sum": one.tolist(),
        "payload": payload,
        "pid": os.getpid(),
        "big": torch.full((1 << 18,), float(ctx.rank)),  # 1 MiB: larger than a pipe buffer
        "raw": raw,
    }


def _wait_for(path, seconds=20.0):
    end = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)


def _record_pid(piddir, rank):
    path = os.path.join(piddir, f"pid{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def _raise_on_one(ctx, piddir):
    _record_pid(piddir, ctx.rank)
    if ctx.rank == 1:
        _wait_for(os.path.join(piddir, "pid0"))  # rank 0 is up and about to block
        raise ValueError("boom")
    time.sleep(300)  # stands for a rank stuck far beyond the test's patience


def _exit_on_one(ctx, piddir):
    _record_pid(piddir, ctx.rank)
    if ctx.rank == 1:
        _wait_for(os.path.join(piddir, "pid0"))
        os._exit(3)
    dist.recv(torch.empty(1), src=1)  # would wait for rank 1 until the pg timeout


def _exit_slowly_on_one(ctx, piddir):
    """Rank 1 is dying: rank 0 sees it at once and raises (as a peer's closed
    connection makes it), while rank 1's process ends only 0.3 s later, as a
    dying process whose memory takes that long to tear down (seen with CUDA
    loaded on a 16-core machine)."""
    _record_pid(piddir, ctx.rank)
    dying, raising = os.path.join(piddir, "dying"), os.path.join(piddir, "raising")
    if ctx.rank == 1:
        open(dying, "w").close()
        _wait_for(raising)  # however late rank 0 gets there, it raises first
        time.sleep(0.3)
        os._exit(3)
    _wait_for(dying)
    open(raising, "w").close()
    raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:6801")


def _die_leaving_a_forked_child(ctx, piddir):
    """Rank 1 forks a child (as a fork-started data loader does), which holds
    its sentinel open for 3 s after rank 1 itself dies silently."""
    _record_pid(piddir, ctx.rank)
    dying = os.path.join(piddir, "dying")
    if ctx.rank == 1:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        open(dying, "w").close()
        os._exit(3)
    _wait_for(dying)
    time.sleep(0.1)
    raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:6801")


def _abort_after_ones_error(ctx, piddir):
    """Rank 0 raises an error of its own; rank 1 then aborts, as NCCL's
    watchdog aborts the survivors of a failed collective."""
    import resource

    _record_pid(piddir, ctx.rank)
    raising = os.path.join(piddir, "raising")
    if ctx.rank == 0:
        open(raising, "w").close()
        raise ValueError("a bug of rank 0's own")
    _wait_for(raising)
    time.sleep(0.5)  # within the grace a lost-peer error waits for a silent death
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.abort()


def _sleep(ctx, *args):
    time.sleep(300)


def _hang_on_one(ctx, piddir):
    _record_pid(piddir, ctx.rank)
    if ctx.rank == 1:
        time.sleep(300)
    return ctx.rank


def _die_at_start_up(piddir, rank):
    """Unpickled in every worker while it loads its args: records the worker's
    pid and, in rank ``rank``, kills it with SIGKILL, i.e. a worker killed
    during start-up, before ``fn`` runs. prepare() has named the process
    ``pipesim-rank<r>`` by then, with the old launcher (args in spawn's pipe)
    and the new one (args in a file) alike."""
    me = int(multiprocessing.current_process().name.rsplit("rank", 1)[1])
    _record_pid(piddir, me)
    if me == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return me


class _KillsRankWhenLoaded:
    def __init__(self, piddir, rank):
        self.piddir, self.rank = piddir, rank

    def __reduce__(self):
        return (_die_at_start_up, (self.piddir, self.rank))


# --- helpers ------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pids(piddir) -> list[int]:
    # a rank stopped while writing leaves its temporary file: not a pid yet
    return [
        int(open(os.path.join(piddir, n)).read())
        for n in sorted(os.listdir(piddir))
        if n.startswith("pid") and not n.endswith(".tmp")
    ]


def _spawned_pids(monkeypatch) -> list[int]:
    """The pid of every worker a launch starts, recorded on the launcher's side
    when it stops them (a worker stopped before it runs fn records nothing)."""
    pids: list[int] = []
    stop = launch_mod._stop_all

    def recording(procs):
        pids.extend(p.pid for p in procs)
        stop(procs)

    monkeypatch.setattr(launch_mod, "_stop_all", recording)
    return pids


def _assert_no_workers_left(pids):
    assert pids, "workers recorded no pids"
    assert multiprocessing.active_children() == []
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]


# --- multi-process ---------------------------------------------------------------


@pytest.mark.multiprocess
def test_results_per_rank_and_collectives_work():
    out = launch(_collective, 2, args=({"x": [1, 2]},), timeout_s=60)
    assert [r["rank"] for r in out] == [0, 1]
    for r in out:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["threads"] == 1
        assert r["sum"] == 1.0  # 0 + 1
        assert r["group_sum"] == [2.0, 2.0, 2.0]
        assert r["payload"] == {"x": [1, 2]}
        assert torch.equal(r["big"], torch.full((1 << 18,), float(r["rank"])))
    _assert_no_workers_left([r["pid"] for r in out])

    prof = commprofile._collective_profile("gloo", [1, 256], 2, [r["raw"] for r in out])
    assert prof.world_size == 2 and prof.sizes == (4, 1024)
    assert all(t > 0 and math.isfinite(t) for t in prof.allreduce_s + prof.allgather_s)
    assert all(b > 0 for b in prof.busbw_Bps)


@pytest.mark.multiprocess
def test_raising_rank_reports_and_stops_the_others(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_raise_on_one, 2, args=(str(tmp_path),), timeout_s=60)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert str(err).splitlines()[0] == "rank 1 failed: ValueError: boom"
    assert "_raise_on_one" in err.traceback and "ValueError: boom" in err.traceback
    assert err.traceback.strip() in str(err)
    assert elapsed < 20, elapsed  # rank 0 was killed, not waited for
    _assert_no_workers_left(_pids(tmp_path))
    again = pickle.loads(pickle.dumps(err))
    assert again.rank == 1 and str(again) == str(err)


def _launch_failure(fn, tmp_path) -> WorkerError:
    """Launch ``fn`` on two ranks, which must fail within 20 s: the error,
    once no worker is left."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(fn, 2, args=(str(tmp_path),), timeout_s=60)
    assert time.monotonic() - t0 < 20
    _assert_no_workers_left(_pids(tmp_path))
    return info.value


@pytest.mark.multiprocess
def test_rank_dying_without_raising_is_reported(tmp_path):
    err = _launch_failure(_exit_on_one, tmp_path)
    assert err.rank == 1 and err.exitcode == 3
    assert str(err).startswith("rank 1 failed:") and "exit code 3" in str(err).splitlines()[0]


@pytest.mark.multiprocess
def test_silent_death_reaped_after_its_peers_error_is_still_the_cause(tmp_path):
    err = _launch_failure(_exit_slowly_on_one, tmp_path)
    assert err.rank == 1 and err.exitcode == 3, str(err)
    assert any(line.startswith("rank 0 failed:") for line in err.others)  # the consequence, listed after


@pytest.mark.multiprocess
def test_silent_death_is_seen_while_a_forked_child_holds_its_sentinel(tmp_path):
    err = _launch_failure(_die_leaving_a_forked_child, tmp_path)
    assert err.rank == 1 and err.exitcode == 3, str(err)


@pytest.mark.multiprocess
def test_death_after_an_error_of_its_own_is_the_consequence(tmp_path):
    err = _launch_failure(_abort_after_ones_error, tmp_path)
    assert err.rank == 0 and err.exc_type == "ValueError", str(err)
    assert "a bug of rank 0's own" in str(err).splitlines()[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_rank_killed_during_start_up_fails_the_launch(tmp_path):
    # args far beyond a pipe buffer (64 KiB), with the killing object first:
    # when args went through spawn's start-up pipe, the parent blocked in
    # Process.start() forever writing them to the dead rank, past any deadline
    big = b"x" * (4 << 20)
    with pytest.raises(WorkerError) as info:
        launch(_sleep, 2, args=(_KillsRankWhenLoaded(str(tmp_path), 1), big), timeout_s=100)
    err = info.value
    # a WorkerError, not a LaunchTimeout: rank 0, asleep for 300 s, was killed, not waited for
    assert err.rank == 1 and err.exitcode == -signal.SIGKILL
    assert str(err).splitlines()[0] == (
        "rank 1 failed: worker died without raising (killed by signal SIGKILL); its stderr, if any, is above"
    )
    # rank 1 recorded its pid as it died; rank 0 may have been stopped before it
    # got that far (its start-up races rank 1's death), so only its absence counts
    assert 1 in [int(n[3:]) for n in os.listdir(tmp_path) if n.startswith("pid") and not n.endswith(".tmp")]
    _assert_no_workers_left(_pids(tmp_path))


@pytest.mark.multiprocess
def test_hanging_rank_times_out(tmp_path, monkeypatch):
    spawned = _spawned_pids(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_one, 2, args=(str(tmp_path),), timeout_s=5)
    elapsed = time.monotonic() - t0
    # rank 0 returns at once unless a loaded machine delays its start past the deadline
    assert info.value.ranks in ((1,), (0, 1))
    assert "ranks still running: [" in str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert 5 <= elapsed < 10, elapsed
    # a machine slower to import torch than the deadline stops both ranks before they record a pid
    assert len(spawned) == 2
    _assert_no_workers_left(sorted(set(_pids(tmp_path)) | set(spawned)))


@pytest.mark.multiprocess
def test_measure_p2p_fits_a_link_the_simulator_accepts():
    p2p = measure_p2p("gloo", sizes=(4, 1 << 16, 1 << 20), repeats=3, warmup=1, timeout_s=60)
    assert p2p.sizes == (4, 1 << 16, 1 << 20)
    assert len(p2p.one_way_s) == 3 and all(t > 0 for t in p2p.one_way_s)
    assert all(lo <= med for lo, med in zip(p2p.min_one_way_s, p2p.one_way_s))
    assert 0 <= p2p.latency_s < 1 and math.isfinite(p2p.latency_s)
    assert 0 < p2p.bandwidth_Bps < math.inf
    hw = Hardware.from_json(hardware_json("measured", "cpu", 1e10, 1e10, 1 << 34, p2p, 2, cores=[0, 1]))
    assert hw.transfer_time(0, 1, 1 << 20) == pytest.approx(p2p.predict(1 << 20))
    # each end's CPU time per message, measured on gloo, and the cpu section fitted to it
    for times in (p2p.send_cpu_s, p2p.recv_cpu_s):
        assert len(times) == 3 and all(0 < t < 1 for t in times)
    assert times[2] > times[0]  # a 1 MiB message costs more CPU than 4 bytes
    assert hw.cpu is not None and hw.cpu.cores == (0, 1) and hw.cpu.send.seconds(1 << 20) > 0
    assert multiprocessing.active_children() == []


# --- no processes ------------------------------------------------------------


def _nested_fn():
    def inner(ctx):
        return 1

    return inner


@pytest.mark.parametrize(
    ("fn", "kwargs", "exc", "match"),
    [
        (lambda ctx: 0, {}, TypeError, "picklable top-level function"),
        (_nested_fn(), {}, TypeError, "picklable top-level function"),
        ("not callable", {}, TypeError, "callable"),
        (_hang_on_one, {"world_size": 0}, ValueError, "world_size"),
        (_hang_on_one, {"world_size": True}, ValueError, "world_size"),
        (_hang_on_one, {"backend": "mpi"}, ValueError, "backend"),
        (_hang_on_one, {"timeout_s": 0}, ValueError, "timeout_s"),
        (_hang_on_one, {"timeout_s": math.inf}, ValueError, "timeout_s"),
        (_hang_on_one, {"threads": 0}, ValueError, "threads"),
        (_hang_on_one, {"devices": [0, 1]}, ValueError, "nccl"),
        (_hang_on_one, {"args": (lambda: 0,)}, TypeError, "picklable"),
    ],
)
def test_bad_arguments_fail_before_spawning(fn, kwargs, exc, match):
    kwargs = {"world_size": 2, **kwargs}
    t0 = time.monotonic()
    with pytest.raises(exc, match=match):
        launch(fn, kwargs.pop("world_size"), timeout_s=kwargs.pop("timeout_s", 30), **kwargs)
    assert time.monotonic() - t0 < 1.0
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="nccl needs CUDA devices"):
        launch(_hang_on_one, 2, backend="nccl")


def test_profiler_argument_errors_spawn_nothing():
    with pytest.raises(ValueError, match="two distinct sizes"):
        measure_p2p(sizes=(4096,))
    with pytest.raises(ValueError, match="sizes"):
        measure_p2p(sizes=(0, 4))
    with pytest.raises(ValueError, match="world_size"):
        commprofile.measure_allreduce(world_size=1)
    with pytest.raises(ValueError, match="repeats"):
        measure_p2p(repeats=0)
    assert multiprocessing.active_children() == []


def test_fit_recovers_latency_and_bandwidth():
    sizes = [4, 4096, 1 << 16, 1 << 20, 1 << 24]
    lat, bw = 50e-6, 2e9
    times = [lat + s / bw for s in sizes]
    got_lat, got_bw = fit_latency_bandwidth(sizes, times)
    assert got_lat == pytest.approx(lat, rel=1e-6)
    assert got_bw == pytest.approx(bw, rel=1e-6)
    # noise that makes the slope non-positive still gives a usable link
    got_lat, got_bw = fit_latency_bandwidth([4, 1 << 20], [2e-3, 1e-3])
    assert got_lat >= 0 and 0 < got_bw < math.inf


def test_hardware_json_round_trips():
    p2p = commprofile.P2PProfile(
        backend="gloo",
        sizes=(4, 1 << 20),
        one_way_s=(1e-4, 6e-4),
        min_one_way_s=(9e-5, 5e-4),
        latency_s=1e-4,
        bandwidth_Bps=2e9,
        repeats=10,
        device="cpu",
    )
    d = hardware_json("loopback-3", "cpu core", 5e10, 8e9, 1 << 34, p2p, 3, device_notes="one core per rank")
    hw = Hardware.from_json(d)
    assert hw.num_devices == 3 and hw.devices_per_node == 3 and hw.nodes == 1
    assert hw.intra_node.kind == "switch"
    assert hw.device.mem_bandwidth == 8e9 and hw.device.flops == 5e10
    assert hw.transfer_time(0, 2, 1 << 20) == pytest.approx(1e-4 + (1 << 20) / 2e9)
    assert Hardware.from_json(hw.to_json()) == hw
    assert "gloo" in d["notes"] and "ping-pong" in d["notes"]
    with pytest.raises(ValueError):
        hardware_json("bad", "cpu", -1, 8e9, 1 << 34, p2p, 2)


def test_hardware_json_cpu_section_from_measured_cpu_times():
    """CPU seconds per message fitted as fixed + bytes / rate per end, and
    the ranks' cores: the simulator's Hardware.cpu."""
    sizes = (4, 1 << 16, 1 << 20)
    send = tuple(3e-5 + n / 3e9 for n in sizes)
    recv = tuple(4e-5 + n / 6e9 for n in sizes)
    p2p = commprofile.P2PProfile(
        backend="gloo",
        sizes=sizes,
        one_way_s=(1e-4, 1.2e-4, 6e-4),
        min_one_way_s=(9e-5, 1e-4, 5e-4),
        latency_s=1e-4,
        bandwidth_Bps=2e9,
        repeats=10,
        device="cpu",
        send_cpu_s=send,
        recv_cpu_s=recv,
    )
    hw = Hardware.from_json(hardware_json("loopback-4", "cpu", 1e12, 8e9, 1 << 34, p2p, 4, cores=[0, 1, 0, 1]))
    assert hw.cpu.cores == (0, 1, 0, 1) and hw.cpu.shared
    assert hw.cpu.send.fixed_s == pytest.approx(3e-5, rel=1e-6) and hw.cpu.send.bytes_per_s == pytest.approx(
        3e9, rel=1e-6
    )
    assert hw.cpu.recv.seconds(1 << 20) == pytest.approx(recv[2], rel=1e-6)
    unmeasured = commprofile.P2PProfile(**{**p2p.to_json(), "send_cpu_s": None, "recv_cpu_s": None})
    assert (
        Hardware.from_json(hardware_json("x", "cpu", 1e12, 8e9, 1 << 34, unmeasured, 4, cores=[0, 1, 0, 1])).cpu is None
    )


def test_memory_bandwidth_is_positive():
    bw = commprofile.measure_memory_bandwidth("cpu", nbytes=1 << 20, repeats=3, warmup=1)
    assert 0 < bw < math.inf


def test_silent_death_not_yet_reaped_is_reported_with_its_code_unknown(tmp_path, monkeypatch):
    """A process whose sentinel fired (it is exiting), with neither a result
    nor an error, died silently even before it can be reaped; one that wrote
    a result or an error did not."""

    class Exiting:
        def __init__(self):
            self.sentinel, w = os.pipe()
            os.close(w)  # what a process's exit does to its sentinel
            self.exitcode = None

        def join(self, timeout=None):
            pass  # never reaped

        def is_alive(self):
            return True

    class Spec:
        def __init__(self, name):
            self.result_path = str(tmp_path / f"{name}.result")
            self.error_path = str(tmp_path / f"{name}.error")

    monkeypatch.setattr(launch_mod, "_REAP_S", 0.05)
    procs, specs = [Exiting() for _ in range(3)], [Spec(n) for n in "abc"]
    open(specs[1].result_path, "w").close()
    open(specs[2].error_path, "w").close()
    try:
        assert launch_mod._silent_deaths(procs, specs, {0, 1, 2}, math.inf) == [(0, None)]
        summary = launch_mod._death_summary(0, None)
        assert "0.05 s after it began to exit, exit code unknown" in summary
    finally:
        for p in procs:
            os.close(p.sentinel)


def test_exit_code_unknown_at_first_is_read_after_a_grace():
    """A silent death reported before it was reaped gets its exit code (and
    the hint that goes with it) once it is; errors with a traceback stay."""

    class Reaped:
        exitcode = None

        def join(self, timeout=None):
            self.exitcode = -signal.SIGKILL

    err = WorkerError(1, launch_mod._death_summary(1, None), others=("rank 0 failed: RuntimeError: closed",))
    out = launch_mod._with_exit_code(err, [Reaped(), Reaped()])
    assert out.exitcode == -signal.SIGKILL and out.rank == 1 and out.others == err.others
    assert "killed by signal SIGKILL" in str(out).splitlines()[0] and "out of memory" in out.hint
    raised = WorkerError(0, "rank 0 failed: ValueError: boom", "Traceback ...", exc_type="ValueError")
    assert launch_mod._with_exit_code(raised, [Reaped()]) is raised

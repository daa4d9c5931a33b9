"""``pipesim validate`` as a library call: profile, simulate, run, compare.

:func:`run_validation` takes a :class:`ValidateConfig` and

1. builds the schedule from the strategy registry (the same IR the simulator
   runs);
2. profiles the model on this machine (per-layer costs, the runtime's pass
   overhead, the optimizer's effective bandwidth; point-to-point latency and
   bandwidth on the backend), unless profile and hardware files are given;
3. partitions the layers with the simulator's partitioner and simulates;
4. runs the schedule for real on the same partition: one process per device
   (gloo or NCCL), or every stage in one process on one device
   (``backend="single"``);
5. reconciles the two timelines (:mod:`pipesim.validate.reconcile`), and
   simulates once more with every pass priced at the speed the run's passes
   measured (``pass_time_ratio``, layers only): the error left is the
   schedule's, the rest is how far the machine's speed moved from its
   profile's.

With ``profiler_trace`` (a folder), step 4 also runs under torch.profiler
and writes a Kineto trace per rank there, ``rank<R>.json.gz``, each action
labelled (grammar and cost: :mod:`pipesim.validate.runtime`); the
reconciliation still reads pipesim's own records.

Single-device mode runs the devices' programs one after another on one
device, in simulated-time order. It measures what every action costs on
that device (the compute model: per-layer times, overheads, the optimizer),
and nothing about overlap, links or bubbles; its prediction is therefore the
simulated actions laid end to end in the order they ran, not the simulated
parallel timeline.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from pipesim.sim.engine.core import simulate as run_engine
from pipesim.sim.engine.metrics import round_sig
from pipesim.sim.engine.results import MemoryTrack, SimResult, Span
from pipesim.sim.errors import InputError
from pipesim.sim.hardware.machines import Hardware, load_hardware
from pipesim.sim.ir.core import Schedule
from pipesim.sim.partition.split import partition
from pipesim.sim.strategies import ScheduleSpec, build_schedule
from pipesim.sim.strategies._common import check_executable
from pipesim.sim.workloads.profile import Profile, at_layer_speed
from pipesim.sim.workloads.readers import load_profile
from pipesim.sim.workloads.stages import StageCost, split_at
from pipesim.validate.allocator import keep_freed_memory
from pipesim.validate.executor import emulate, iteration_losses
from pipesim.validate.launch import core_assignment, measure_wake_slice
from pipesim.validate.models import ModelError, RealModel, layer_param_bytes, layer_stats
from pipesim.validate.numerics import EXECUTOR_THREADS, intra_op_threads
from pipesim.validate.profiler import ProfileSettings, kernel_bandwidths, profile_model
from pipesim.validate.reconcile import compare, iteration_time, measured_result, pass_time_ratio
from pipesim.validate.runtime import Job, run_distributed
from pipesim.validate.stage import OptimizerConfig

BACKENDS = ("gloo", "nccl", "single")


class ValidateError(InputError):
    """A validation run this machine cannot do, or bad arguments (one line)."""


@dataclass(frozen=True)
class ValidateConfig:
    """What to validate. ``replicas`` is the number of parallel pipelines
    (the strategies' width); ``model_width``/``model_depth`` size the model."""

    strategy: str
    stages: int = 2
    microbatches: int = 8
    model: str = "mlp"
    backend: str = "gloo"
    iterations: int = 8  # the CLI's default (experiments/cli/validate.py ITERATIONS)
    microbatch_size: int = 32
    replicas: int = 1
    model_width: int | None = None
    model_depth: int | None = None
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    synthetic: bool = False
    recv_lookahead: int = 1
    timeout_s: float = 600.0
    profile_path: str | None = None
    hardware_path: str | None = None
    profile_repeats: int = 15
    oversubscribe: bool = False
    strategy_options: tuple = ()  # extra ScheduleSpec fields as (name, value) pairs
    profiler_trace: str | None = None  # a folder for torch.profiler traces, rank<R>.json.gz (runtime's doc)


def torch_device(backend: str) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise ValidateError("--backend nccl needs CUDA devices, and this machine has none (use gloo)")
        return torch.device("cpu")
    return torch.device("cuda", 0)


def check_machine(cfg: ValidateConfig, schedule: Schedule) -> None:
    """Refuse runs this machine cannot do (or cannot time meaningfully)."""
    if cfg.backend not in BACKENDS:
        raise ValidateError(f"unknown backend {cfg.backend!r} (choose from: {', '.join(BACKENDS)})")
    n = schedule.num_devices
    if cfg.backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < n:
            raise ValidateError(
                f"{cfg.strategy} needs {n} GPUs for --backend nccl; this machine has {have} "
                "(use --backend single to run every stage on one GPU)"
            )
    if cfg.backend == "gloo" and not cfg.oversubscribe:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if n > cores:
            raise ValidateError(
                f"{cfg.strategy} needs {n} worker processes but this machine has {cores} cores: "
                "timings would measure the OS scheduler (pass --oversubscribe to run anyway, "
                "or use --backend single)"
            )


def check_fits(cfg: ValidateConfig, model: RealModel) -> None:
    """Refuse, before anything is measured, a micro-batch whose one forward
    and backward alone would not fit in this machine's memory: what one
    sample's layers output and stash (measured with a micro-batch of one,
    :func:`~pipesim.validate.models.layer_stats`) times the micro-batch
    size. A lower bound (stages hold several micro-batches in flight), so
    what it refuses cannot run; it keeps a typo from building the batch."""
    from pipesim.sim.engine.size import available_memory_bytes

    if model.origin != "catalog":  # several tensors across a cut; a factory's batch is fixed
        from pipesim.validate.usermodels import check_activations

        try:
            check_activations(model, cfg.microbatch_size)
        except ModelError as e:
            raise ValidateError(str(e)) from None
        return
    per_sample = sum(s.activation_bytes + s.stash_bytes for s in layer_stats(model, 1))
    need, available = per_sample * cfg.microbatch_size, available_memory_bytes()
    if available is not None and need > available:
        raise ValidateError(
            f"a micro-batch of {cfg.microbatch_size} samples of {cfg.model} needs at least "
            f"{need / 2**30:,.1f} GiB for its activations ({per_sample:,} bytes a sample) and this "
            f"machine has {available / 2**30:,.1f} GiB available: use a smaller --microbatch-size"
        )


def build(cfg: ValidateConfig) -> Schedule:
    check_executable(cfg.strategy, "real-tensor executors")  # before anything is launched
    opts = dict(cfg.strategy_options)
    if cfg.replicas != 1:
        opts["width"] = cfg.replicas
    spec = ScheduleSpec(
        strategy=cfg.strategy, stages=cfg.stages, microbatches=cfg.microbatches, iterations=cfg.iterations, **opts
    )
    return build_schedule(spec)


def _executor_threads(device: torch.device) -> int | None:
    """Intra-op threads to measure and run with on ``device``: a CPU
    worker's count (what every rank computes with), torch's own on a GPU."""
    return EXECUTOR_THREADS if device.type == "cpu" else None


def model_of(cfg: ValidateConfig) -> RealModel:
    """The real model ``cfg`` names: a catalog model, or ``hf:``,
    ``torchvision:``, ``module:factory`` (:func:`~pipesim.validate.usermodels.resolve_model`;
    a one-line :class:`ModelError` if it cannot be built)."""
    from pipesim.validate.usermodels import resolve_model

    return resolve_model(
        cfg.model,
        width=cfg.model_width,
        depth=cfg.model_depth,
        seed=cfg.seed,
        microbatch_size=cfg.microbatch_size,
        memory_check=False,
    )


def profile(
    cfg: ValidateConfig,
    device: torch.device,
    progress=None,
    *,
    model: RealModel | None = None,
    hardware: Hardware | None = None,
) -> Profile:
    """The model's per-layer costs on ``device``; with a distributed backend,
    the per-pass overhead is the runtime's measured cost per pass when
    passing tensors of the model's typical boundary size
    (:func:`~pipesim.validate.profiler.measure_dispatch`), less the CPU time
    ``hardware.cpu`` charges the pass's send separately (on a CPU the
    period of those passes contains it)."""
    model = model or model_of(cfg)
    settings = ProfileSettings(microbatch_size=cfg.microbatch_size, repeats=cfg.profile_repeats)
    with intra_op_threads(_executor_threads(device)):
        prof = profile_model(model, device=device, settings=settings, progress=progress)
    if cfg.backend in ("gloo", "nccl"):
        from pipesim.validate.profiler import measure_dispatch

        boundary = int(statistics.median(la.activation_bytes for la in prof.layers[:-1] or prof.layers))
        o_f, o_b = measure_dispatch(cfg.backend, boundary, timeout_s=min(cfg.timeout_s, 120.0))
        send = hardware.cpu.send.seconds(boundary) if hardware is not None and hardware.cpu is not None else 0.0
        prof = replace(
            prof,
            overhead_forward_s=max(prof.overhead_forward_s, o_f - send),
            overhead_backward_s=max(prof.overhead_backward_s, o_b - send),
            notes=prof.notes + f"; per-pass overhead measured in the {cfg.backend} runtime passing "
            f"{boundary} bytes"
            + (f", less the send's {send * 1e6:.1f} us of CPU the simulator charges apart" if send else ""),
        )
    return prof


def hardware_for(
    cfg: ValidateConfig, device: torch.device, num_devices: int, *, model: RealModel | None = None
) -> Hardware:
    """This machine as the simulator sees it: measured links and update bandwidth."""
    from pipesim.validate.commprofile import hardware_json, measure_p2p

    model = model or model_of(cfg)
    with intra_op_threads(_executor_threads(device)):
        kernels = kernel_bandwidths(
            model,
            device=device,
            optimizer=cfg.optimizer,
            settings=ProfileSettings(microbatch_size=cfg.microbatch_size, repeats=7),
        )
    bw = kernels["update"]
    if cfg.backend == "single" or num_devices == 1:
        p2p = None
    else:
        p2p = measure_p2p(backend=cfg.backend, timeout_s=min(cfg.timeout_s, 120.0))
    cores = core_assignment(num_devices) if cfg.backend == "gloo" else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    n = max(num_devices, 1)
    if p2p is None:  # one device: nothing is transferred between processes
        d = {
            "name": f"measured-{cfg.backend}",
            "notes": "single-device mode: no links measured",
            "device": {"name": name, "flops": 1e12, "mem_bandwidth": bw, "memory_bytes": float(memory)},
            "num_devices": n,
            "devices_per_node": n,
            "intra_node": {"kind": "ideal"},
        }
    else:
        shared = cores is not None and len(set(cores)) < len(cores)
        wake = measure_wake_slice(cores[0]) if shared else 0.0  # matters only where ranks share a core
        d = hardware_json(f"measured-{cfg.backend}", name, 1e12, bw, memory, p2p, n, cores=cores, wake_slice_s=wake)
    # flops is unused: the measured profile gives every layer's time directly
    d["device"].update({f"{k}_bandwidth": v for k, v in kernels.items()})
    d["device"]["notes"] = (
        d["device"].get("notes", "") + " mem_bandwidth is the in-place optimizer step's; "
        "update/predict/average_bandwidth are each kernel's, measured as the runtime runs it "
        "(pipesim.validate.profiler.kernel_bandwidths)"
    ).strip()
    return Hardware.from_json(d)


def ring_allreduce_prediction(hw: Hardware, devices: int, nbytes: int) -> float:
    """What the simulator charges for an all-reduce of ``nbytes`` over the first ``devices`` devices."""
    return hw.ring_allreduce_time(list(range(devices)), nbytes)


def serialized(predicted: SimResult, measured: SimResult) -> SimResult:
    """What single-device mode can predict: the predicted compute actions
    laid end to end in the order the single-device run executed them, and
    the memory of every simulated device held on that one device
    (:func:`summed_memory`)."""
    dur = {(s.device, s.action): s.duration for s in predicted.by_stream()["compute"]}
    t = 0.0
    spans = []
    for s in sorted(measured.by_stream()["compute"], key=lambda s: s.start):
        d = dur[(s.device, s.action)]
        spans.append(Span(s.device, "compute", s.action, t, t + d))
        t += d
    sends = [(s.start, s.end, s.nbytes) for s in predicted.by_stream()["send"] if s.nbytes]
    return replace(predicted, spans=spans, memory=[summed_memory(predicted.memory, sends)] if predicted.memory else [])


def summed_memory(tracks: list[MemoryTrack], sends: list[tuple[float, float, int]] = ()) -> MemoryTrack:
    """One device holding what every track holds, at every simulated time.

    The single-device run executes the devices' programs in simulated-time
    order, so what it holds at a point is each simulated device's memory at
    that time, summed: the peak of that sum, not the sum of the peaks (the
    devices peak at different times), nor one device's peak.

    ``sends`` are ``(start, end, bytes)`` of the simulated transfers. The
    simulator holds a send buffer on the sender and a receive buffer on the
    receiver while a transfer runs; one device hands the sender's tensor to
    its consumer instead (``executor.LocalComm``), so the send buffers are
    taken out of the sum."""
    starts = np.asarray([s for s, _, _ in sends], dtype=float)
    ends = np.asarray([e for _, e, _ in sends], dtype=float)
    times = np.unique(np.concatenate([np.asarray(t.times, dtype=float) for t in tracks] + [starts, ends]))
    total = np.zeros(len(times), dtype=np.int64)
    for t in tracks:
        if t.times:
            at = np.searchsorted(np.asarray(t.times, dtype=float), times, side="right") - 1
            total += np.where(at >= 0, np.asarray(t.totals, dtype=np.int64)[np.maximum(at, 0)], 0)
    if len(starts):
        nbytes = np.asarray([n for _, _, n in sends], dtype=np.int64)
        by_start, by_end = np.argsort(starts, kind="stable"), np.argsort(ends, kind="stable")
        begun = np.concatenate([[0], np.cumsum(nbytes[by_start])])[np.searchsorted(starts[by_start], times, "right")]
        done = np.concatenate([[0], np.cumsum(nbytes[by_end])])[np.searchsorted(ends[by_end], times, "right")]
        total -= begun - done
    peak = int(np.argmax(total)) if len(total) else 0
    return MemoryTrack(
        device=0,
        capacity_bytes=tracks[0].capacity_bytes,
        times=times.tolist(),
        totals=total.tolist(),
        peak_bytes=int(total[peak]) if len(total) else 0,
        peak_time=float(times[peak]) if len(times) else 0.0,
    )


@dataclass
class Validation:
    """Everything one validation produced."""

    report: dict
    predicted: SimResult
    measured: SimResult
    profile: Profile
    hardware: Hardware


def run_validation(cfg: ValidateConfig, progress=None) -> Validation:
    """Profile, simulate, run and compare (see the module doc)."""
    say = progress or (lambda msg: None)
    keep_freed_memory()  # single-device runs execute here, as the profiler measures (allocator.py)
    schedule = build(cfg)
    check_machine(cfg, schedule)
    device = torch_device(cfg.backend)
    model = model_of(cfg)
    if schedule.num_stages > model.num_layers:  # fail before any measuring
        raise ValidateError(
            f"{schedule.num_stages} stages need at least that many layers; {cfg.model} has "
            f"{model.num_layers} (raise --model-depth)"
        )
    check_fits(cfg, model)
    prof, hw = _measurements(cfg, schedule, device, model, say)
    costs = partition(prof, schedule.num_stages)
    starts = tuple(c.first_layer for c in costs)

    def simulate(stage_costs: list[StageCost], hardware: Hardware, meta: dict | None = None) -> SimResult:
        return run_engine(
            schedule,
            stage_costs,
            hardware,
            microbatch_size=cfg.microbatch_size,
            optimizer=prof.optimizer,
            recv_lookahead=cfg.recv_lookahead,
            meta=meta,
        )

    say(f"simulating {cfg.strategy} (stages start at layers {list(starts)}) ...")
    predicted = simulate(costs, hw, {"model": prof.name, "hardware": hw.name, "optimizer": prof.optimizer})
    job = Job(
        schedule=schedule,
        model=cfg.model,
        starts=starts,
        microbatch_size=cfg.microbatch_size,
        optimizer=cfg.optimizer,
        width=cfg.model_width,
        depth=cfg.model_depth,
        seed=cfg.seed,
        synthetic=cfg.synthetic,
        recv_lookahead=cfg.recv_lookahead,
        profiler_trace=_profiler_folder(cfg.profiler_trace),
        return_weights=False,  # nothing here compares weights
    )
    out = _execute(cfg, job, device, predicted, say)
    measured = measured_result(
        schedule,
        out.records,
        microbatch_size=cfg.microbatch_size,
        stage_costs=costs,
        meta={"model": cfg.model, "backend": cfg.backend, "measured": True},
    )
    reference = serialized(predicted, measured) if cfg.backend == "single" else predicted
    report = _run_facts(cfg, schedule, model, device, starts, prof, hw)
    report.update(
        compare(
            reference,
            measured,
            losses=iteration_losses(out.losses, schedule.num_microbatches),
            versions_used=out.versions_used,
            peak_memory=out.peak_memory or None,
            held_activations=out.held_activations or None,
            held_reference=predicted,
        )
    )
    t_meas = report["iteration_time_measured_s"]
    ratio = pass_time_ratio(predicted, measured, prof)
    if ratio is not None and t_meas > 0:
        # the prediction at the speed the run's passes ran: what is left of the error is the schedule's
        at_speed = simulate(split_at(at_layer_speed(prof, ratio), starts), hw)
        t = iteration_time(serialized(at_speed, measured) if cfg.backend == "single" else at_speed)
        report["pass_time_ratio"] = round_sig(ratio)
        report["iteration_time_predicted_at_run_speed_s"] = round_sig(t)
        report["iteration_time_error_at_run_speed"] = round_sig((t - t_meas) / t_meas)
    if hw.cpu is not None and cfg.backend != "single":
        # what the prediction would be without the cores' model: its share of the result
        t = iteration_time(simulate(costs, replace(hw, cpu=None)))
        report["iteration_time_predicted_without_cpu_model_s"] = round_sig(t)
        report["iteration_time_error_without_cpu_model"] = round_sig((t - t_meas) / t_meas)
    if cfg.backend == "single" and out.peak_memory:
        report["peak_memory_note"] = (
            "single-device mode holds every stage on one device: measured is its peak, "
            "predicted the peak of every simulated device's memory summed over time"
        )
    report["unscheduled_predictions"] = out.unscheduled_predictions
    if cfg.profiler_trace is not None:
        report["profiler_trace"] = str(cfg.profiler_trace)
    return Validation(report, reference, measured, prof, hw)


def _profiler_folder(folder: str | None) -> str | None:
    """``--profiler-trace``'s folder, made and emptied of an earlier run's
    traces (so every trace in it is this run's); absolute, for the workers."""
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            if re.fullmatch(r"\.?rank\d+(\.part)?\.json\.gz", name):
                os.remove(os.path.join(folder, name))
    except OSError as e:
        raise ValidateError(f"cannot write profiler traces to {folder}: {e.strerror or e}") from None
    return os.path.abspath(folder)


def _measurements(
    cfg: ValidateConfig, schedule: Schedule, device: torch.device, model: RealModel, say
) -> tuple[Profile, Hardware]:
    """The profile and hardware to simulate with: given files, or measured
    here; checked against the schedule and the model."""
    prof = _profile_file(cfg) if cfg.profile_path else None  # a bad file is named before any measuring
    # the hardware before a measured profile: its per-pass overhead leaves out what it charges transfers
    if cfg.hardware_path:
        hw = load_hardware(cfg.hardware_path)
    else:
        say(f"measuring {cfg.backend} links and the optimizer's bandwidth ...")
        hw = hardware_for(cfg, device, schedule.num_devices, model=model)
    if prof is None:
        say(f"profiling {cfg.model} layers on {device} ...")
        prof = profile(cfg, device, model=model, hardware=hw)
    if hw.num_devices is not None and hw.num_devices < schedule.num_devices:
        raise ValidateError(
            f"hardware {hw.name!r} has {hw.num_devices} devices; {cfg.strategy} needs {schedule.num_devices}"
        )
    if model.num_layers != prof.num_layers:
        raise ValidateError(f"the profile has {prof.num_layers} layers but {cfg.model} has {model.num_layers}")
    _check_same_model(cfg, model, prof)
    # the optimizer is the run's: a profile's layer times do not depend on it, its updates' cost does
    # (priced from the hardware's update bandwidth), and `pipesim profile` always writes SGD
    return replace(prof, optimizer=cfg.optimizer.kind), hw


def _check_same_model(cfg: ValidateConfig, model: RealModel, prof: Profile) -> None:
    """A profile file must be of the model this run builds: its layers'
    weights are the model's (a profile of ``--model-width 512`` priced a
    width-64 run's layers eight times too slow)."""
    sizes = [layer_param_bytes(layer) for layer in model.layers]
    for k, (mine, theirs) in enumerate(zip(sizes, (la.param_bytes for la in prof.layers), strict=True)):
        if mine != theirs:
            raise ValidateError(
                f"the profile's layer {k} has {theirs:,} bytes of weights, {cfg.model}'s here "
                f"{mine:,}: it was measured on another model size (--model-width, --model-depth); "
                "profile this one, or pass the sizes it was measured at"
            )


def _profile_file(cfg: ValidateConfig) -> Profile:
    """``--profile``'s profile, which must have been measured at the run's
    micro-batch size: its times and activation sizes are that size's, and
    relabelling them would predict another run than the one measured."""
    prof = load_profile(cfg.profile_path)
    measured_in = _profiled_backend(prof)
    if measured_in is not None and measured_in != cfg.backend:
        raise ValidateError(
            f"the profile {cfg.profile_path} was measured with --backend {measured_in} (its per-pass "
            f"overhead is that runtime's), this run uses {cfg.backend}: pass --backend {measured_in}, "
            f"or profile again with --backend {cfg.backend}"
        )
    if prof.microbatch_size != cfg.microbatch_size:
        raise ValidateError(
            f"the profile {cfg.profile_path} was measured at micro-batch size "
            f"{prof.microbatch_size}, this run uses {cfg.microbatch_size}: pass --microbatch-size "
            f"{prof.microbatch_size}, or profile again at {cfg.microbatch_size}"
        )
    return prof


def _profiled_backend(prof: Profile) -> str | None:
    """The backend ``pipesim profile`` measured ``prof`` with, as its notes
    say (a distributed one adds its runtime's per-pass overhead); None for a
    profile it did not write."""
    if "measured by pipesim profile" not in prof.notes:
        return None
    found = re.search(r"per-pass overhead measured in the (\w+) runtime", prof.notes)
    return found.group(1) if found else "single"


def _execute(cfg: ValidateConfig, job: Job, device: torch.device, predicted: SimResult, say):
    """Run ``job`` for real: every stage in this process (single-device mode),
    or one worker process per device."""
    schedule = job.schedule
    if cfg.backend != "single":
        say(f"running {schedule.num_devices} {cfg.backend} workers ...")
        return run_distributed(job, backend=cfg.backend, timeout_s=cfg.timeout_s)
    from pipesim.validate.runtime import local_stages, profiled, seed_passes, warm_up

    say(f"running every stage in this process on {device} ...")
    seed_passes(job.seed, 0)
    with intra_op_threads(_executor_threads(device)):
        stages, data, specs = local_stages(job, schedule.placement(), device)
        warm_up(stages, data, specs, device)
        info = {"devices": list(range(schedule.num_devices)), "clock_offset_ns": 0}
        with profiled(job.profiler_trace, 0, device, info):
            out = emulate(
                schedule,
                stages,
                data,
                cfg.optimizer,
                predicted,
                recv_lookahead=cfg.recv_lookahead,
                timed=True,
                threads=None,
                annotate=job.profiler_trace is not None,
                held=job.held_activations,
            )  # synchronises a GPU before it returns
    if device.type == "cuda":
        out.peak_memory = {0: torch.cuda.max_memory_allocated(device)}
    return out


def _run_facts(
    cfg: ValidateConfig, schedule: Schedule, model: RealModel, device: torch.device, starts, prof: Profile, hw: Hardware
) -> dict:
    """What ran, on what, with which measurements: the head of report.json."""
    link_bw = hw.intra_node.bandwidth
    return {
        "strategy": cfg.strategy,
        "stages": schedule.num_stages,
        "devices": schedule.num_devices,
        "replicas": schedule.num_replicas,
        "microbatches": schedule.num_microbatches,
        "iterations": schedule.num_iterations,
        "microbatch_size": cfg.microbatch_size,
        "model": model.description,
        "backend": cfg.backend,
        "mode": "single-device (serialized)" if cfg.backend == "single" else "one process per device",
        "device": str(device),
        "freed_memory": keep_freed_memory(),
        "partition_starts": list(starts),
        "optimizer": asdict(cfg.optimizer),
        "hardware": {
            "name": hw.name,
            "mem_bandwidth_Bps": round_sig(hw.device.mem_bandwidth),
            "link_bandwidth_Bps": round_sig(link_bw) if link_bw != float("inf") else None,
            "link_latency_s": round_sig(hw.intra_node.latency),
        },
        "profile": {
            "overhead_forward_s": round_sig(prof.overhead_forward_s),
            "overhead_backward_s": round_sig(prof.overhead_backward_s),
            "layers": prof.num_layers,
        },
    }

"""DeepSpeed integration: ``trainer_hooks.deepspeed.instrument(engine)``.

    engine, *_ = deepspeed.initialize(...)
    tracer = trainer_hooks.deepspeed.instrument(engine, meta={"flops_per_token": ...})
    for n in range(steps):
        with tracer.step(n):
            engine.train_batch(data_iter)        # PipelineEngine: every instruction is timed
    tracer.close()

For a plain ``DeepSpeedEngine`` (no pipeline) wrap the phases yourself (``tracer.phase("forward")``
around ``engine(x)``, ``"backward"`` around ``engine.backward(loss)``, ``"optimizer"`` around
``engine.step()``) or call ``instrument(..., phases=True)`` to have ``forward``/``backward``/``step``
wrapped on the instance.

What it does: names the process groups from the engine's topology (``tp``/``pp``/``dp``/``mp``),
times every torch.distributed collective (restored on close), shadows the PipelineEngine's
instruction map with timed handlers, wraps the ZeRO optimizer's offload copies, and records
RUN_START with the run's shape. Nothing in DeepSpeed is edited.
"""

from __future__ import annotations

from typing import Any

from trainer_hooks.integrations import offload as offload_mod
from trainer_hooks.integrations import pipeline as pipeline_mod
from trainer_hooks.tracer import Tracer

#: topology axis -> role name
AXIS_ROLES = {"model": "tp", "pipe": "pp", "data": "dp"}


def topology_axes(topo: Any) -> dict[str, list[tuple[int, ...]]]:
    """Role -> rank lists from a DeepSpeed ProcessTopology: tp/pp/dp along each axis, and ``mp``
    (every pipeline and tensor rank of one data-parallel replica)."""
    axes: dict[str, list[tuple[int, ...]]] = {}
    names = topo.get_axis_names()
    for axis, role in AXIS_ROLES.items():
        if axis in names:
            axes[role] = [tuple(sorted(r)) for r in topo.get_axis_comm_lists(axis)]
    if "data" in names:
        axes["mp"] = [tuple(sorted(topo.get_axis_list("data", d))) for d in range(topo.get_dim("data"))]
    return axes


def _coord_of(topo: Any):
    coords = {topo.get_rank(**c._asdict()): c._asdict() for c in topo.mapping}

    def coord_of(rank: int) -> dict[str, int]:
        return coords[rank]

    return coord_of


def instrument(
    engine: Any,
    tracer: Tracer | None = None,
    *,
    topology: Any = None,
    meta: dict[str, Any] | None = None,
    phases: bool = False,
    **tracer_kwargs: Any,
) -> Tracer:
    """Instrument a DeepSpeedEngine or PipelineEngine on this rank; returns the Tracer.

    ``meta`` may carry: tp, pp, dp, zero_stage, stage, model_name, n_params, flops_per_token,
    peak_flops, micro_batch, micro_batches, seq_len, ds_config (a dict); anything else goes into
    RUN_START's meta_json. ``topology`` defaults to the engine's (``engine.mpu`` / ``grid``)."""
    meta = dict(meta or {})
    meta_topology = meta.pop("topology", None)
    topology = topology if topology is not None else meta_topology
    if topology is None:
        grid = getattr(engine, "grid", None) or getattr(engine, "mpu", None)
        topology = getattr(grid, "_topo", None) or getattr(grid, "topology", lambda: None)()
    if tracer is None:
        tracer = Tracer(**tracer_kwargs)
    if not tracer.enabled:
        return tracer
    try:
        tp = int(meta.pop("tp", topology.get_dim("model") if topology is not None else 1) or 1)
        pp = int(meta.pop("pp", topology.get_dim("pipe") if topology is not None else 1) or 1)
        dp = int(meta.pop("dp", topology.get_dim("data") if topology is not None else tracer.world_size) or 1)
        if topology is not None:
            tracer.set_topology(topology_axes(topology), _coord_of(topology), dict(AXIS_ROLES))
            stage = meta.pop("stage", topology.get_coord(tracer.rank).pipe if pp > 1 else -1)
        else:
            tracer.set_topology({"dp": [tuple(range(tracer.world_size))]})
            stage = meta.pop("stage", -1)
        micro_batch = int(meta.pop("micro_batch", _call(engine, "train_micro_batch_size_per_gpu", -1)))
        micro_batches = int(meta.pop("micro_batches", _call(engine, "gradient_accumulation_steps", -1)))
        seq_len = int(meta.pop("seq_len", -1))
        if micro_batch > 0 and micro_batches > 0:
            if tracer.samples_per_step < 0:
                tracer.samples_per_step = micro_batch * micro_batches
            if tracer.tokens_per_step < 0 and seq_len > 0:
                tracer.tokens_per_step = micro_batch * micro_batches * seq_len
        tracer.model_share = 1.0 / max(1, tp * pp)
        zero_stage = int(meta.pop("zero_stage", _call(engine, "zero_optimization_stage", 0)))
        ds_config = meta.pop("ds_config", None) or getattr(getattr(engine, "_config", None), "_param_dict", None)
        local_params = sum(p.numel() for p in engine.module.parameters()) if hasattr(engine, "module") else -1
        pipelined = pipeline_mod.wrap(engine, tracer) if pp > 1 or hasattr(type(engine), "_INSTRUCTION_MAP") else False
        wrapped_offload = offload_mod.wrap(getattr(engine, "optimizer", None), tracer)
        if phases and not pipelined:
            _wrap_phases(engine, tracer)
        _wrap_train_batch(engine, tracer)
        tracer.describe(
            tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, stage=stage,
            model_name=str(meta.pop("model_name", type(getattr(engine, "module", engine)).__name__)),
            n_params=int(meta.pop("n_params", -1)), flops_per_token=meta.pop("flops_per_token", None),
            peak_flops=meta.pop("peak_flops", None), micro_batch=micro_batch, micro_batches=micro_batches,
            seq_len=seq_len, ds_config=ds_config, local_params=local_params, pipeline_instrumented=pipelined,
            offload_wrapped=wrapped_offload, **meta,
        )
    except Exception as e:
        tracer.close()
        raise RuntimeError(
            f"trainer_hooks.integrations.deepspeed.instrument: could not instrument {type(engine).__name__}: {e!r}; "
            "call it after deepspeed.initialize() on every rank, or pass topology= explicitly"
        ) from e
    original_close = tracer.close

    def close() -> None:
        pipeline_mod.unwrap(engine)
        offload_mod.unwrap(getattr(engine, "optimizer", None))
        if phases:
            for name in ("forward", "backward", "step"):
                engine.__dict__.pop(name, None)
        engine.__dict__.pop("train_batch", None)
        original_close()

    tracer.close = close  # type: ignore[method-assign]
    return tracer


def _wrap_train_batch(engine: Any, tracer: Tracer) -> None:
    """What ``train_batch`` returns (the step's loss) goes to ``tracer.set_loss``."""
    original = getattr(engine, "train_batch", None)
    if not callable(original):
        return

    def train_batch(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        tracer.set_loss(out)
        return out

    engine.train_batch = train_batch


def _call(obj: Any, name: str, default: Any) -> Any:
    try:
        return getattr(obj, name)()
    except Exception:
        return default


def _wrap_phases(engine: Any, tracer: Tracer) -> None:
    for name, phase in (("forward", "forward"), ("backward", "backward"), ("step", "optimizer")):
        fn = getattr(engine, name)

        def make(fn: Any = fn, phase: str = phase) -> Any:
            def timed(*a: Any, **kw: Any) -> Any:
                with tracer.phase(phase):
                    return fn(*a, **kw)

            return timed

        setattr(engine, name, make())

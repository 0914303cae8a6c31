"""``gradzip.attach(model, spec)``: compress a data-parallel model's gradient traffic.

Dispatches on the wrapper, one ``apply_*`` each: DDP gets a comm hook, FSDP2
(``fully_shard``) units a compressed ``ReduceScatter`` each, FSDP1 a comm hook. The
codecs are built first, so a bad spec raises ``SpecError`` here, before training
starts, and a spec that cannot compress on a path is refused here too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial, wraps
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, cast

import torch.distributed as dist
from torch import nn

from gradzip.codecs.chain import Codec
from gradzip.codecs.registry import SpecError
from gradzip.collectives.linkmodel import backend_model
from gradzip.comm.chained import chainable
from gradzip.comm.communicator import TorchCommunicator
from gradzip.comm.ddp import (
    START_ITERATION,
    START_ITERATION_STATIC_GRAPH,
    DDPCommState,
    build_codec,
    gradzip_hook,
    load_codec_states,
    sends_plain,
)
from gradzip.comm.eventtimes import EventTimings
from gradzip.comm.fsdp import (
    CommCache,
    CompressedReduceScatter,
    FSDP1CommState,
    fsdp1_hook,
    shard_shapes,
    unit_parameters,
)
from gradzip.comm.groups import on_device
from gradzip.comm.hsdp import (
    NativeShard,
    OnDevice,
    ReplicateReduce,
    native_hsdp,
    shard_group,
    split_spec,
)
from gradzip.comm.pending import AtBackwardEnd
from gradzip.comm.policy import Policy
from gradzip.comm.reducer import Reducer
from gradzip.comm.stats import CommStats

if TYPE_CHECKING:
    from gradzip.comm.auto import AutoOptions
    from gradzip.comm.method import AutoMethod, CodecMethod


class Handle:
    """What ``attach`` returns: the codecs, their stats, checkpointable state.

    ``codec`` is the default codec; ``codecs`` lists it first, then one per policy
    group (``policy.groups`` in order).
    """

    def __init__(self, kind: str, codecs: list[Codec], stats: CommStats, policy: Policy,
                 ddp_state: DDPCommState | None = None) -> None:
        self.kind = kind  # "ddp", "fsdp2" or "fsdp1"
        self.codecs = codecs
        self.stats = stats
        self.policy = policy
        self._ddp_state = ddp_state
        #: FSDP2's compressed reduce-scatters, one per unit
        self.reduce_scatters: list[CompressedReduceScatter] = []
        #: HSDP: the replicate link's codecs by policy group (empty otherwise)
        self.replicate_codecs: list[Codec] = []
        self.replicate_policy: Policy | None = None
        #: the ``gradzip.capture.Capture`` recording the buckets, if any
        self.capture: Any = None

    @property
    def codec(self) -> Codec:
        return self.codecs[0]

    @property
    def chained(self) -> bool:
        """Whether DDP buckets run on the future-chained path (``comm/chained.py``: one
        summable stage, no communication thread) rather than on the comm thread."""
        return self._ddp_state is not None and self._ddp_state.chained

    def state_dict(self) -> dict[str, Any]:
        """Codec state of this rank (EF residuals, PowerSGD Q, momentum); HSDP's replicate
        link's under ``"replicate"``."""
        sd: dict[str, Any] = {"kind": self.kind, "codec": self.codec.state_dict(),
                              "groups": [c.state_dict() for c in self.codecs[1:]]}
        if self.replicate_codecs:
            sd["replicate"] = {"codec": self.replicate_codecs[0].state_dict(),
                               "groups": [c.state_dict() for c in self.replicate_codecs[1:]]}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != self.kind:
            raise ValueError(f"comm state was saved for {sd.get('kind')!r}, this is {self.kind!r}")
        if bool(self.replicate_codecs) != ("replicate" in sd):
            raise ValueError("comm state was saved with" + ("out" if self.replicate_codecs
                             else "") + " an HSDP replicate link; resume the same way")
        load_codec_states(self.codecs, sd)
        if self.replicate_codecs:
            load_codec_states(self.replicate_codecs, sd["replicate"])

    def close(self) -> None:
        """Stop the communication thread (DDP) and close the capture; the hook must not
        run afterwards."""
        if self._ddp_state is not None:
            self._ddp_state.close()
        if self.capture is not None:
            self.capture.close()

    def __repr__(self) -> str:
        return f"gradzip.comm.Handle({self.kind}, {str(self.policy)!r})"


P = ParamSpec("P")


def _on_model_device(fn: Callable[Concatenate[nn.Module, P], Handle],
                     ) -> Callable[Concatenate[nn.Module, P], Handle]:
    """Run ``fn(model, ...)`` with ``model``'s CUDA device current (``groups.on_device``):
    attaching exchanges objects, which NCCL stages on the current device."""
    @wraps(fn)
    def on_model_device(model: nn.Module, *args: P.args, **kwargs: P.kwargs) -> Handle:
        with on_device(model):
            return fn(model, *args, **kwargs)
    return on_model_device


@_on_model_device
def attach(
    model: nn.Module,
    spec: str | Codec | dict[str, Any] | Policy | CodecMethod | AutoMethod | AutoOptions,
    *,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
    diagnose: bool = False,
    nonfinite: str = "error",
    groups: dict[str, str] | None = None,
    start_step: int | None = None,
    aggregate: str | None = None,
    capture: Any = None,
    replicate_group: dist.ProcessGroup | None = None,
    node_size: int = 0,
) -> Handle:
    """Compress ``model``'s gradient communication with ``spec``; returns a ``Handle``.

    ``model`` is a ``DistributedDataParallel`` module, a ``fully_shard``-ed (FSDP2)
    module, or a ``FullyShardedDataParallel`` (FSDP1) root. Call on every rank.
    ``spec`` is a codec spec, a parsed ``Method`` of codecs (``method.py``; its specs
    are not parsed again) or a policy (``policy.py``: per-parameter codecs and a
    start step, e.g. ``{"codec": "ef | topk(ratio=0.01)", "groups": [{"params":
    ["*.bias", "*norm*"], "codec": "none"}], "start_step": 100}``); ``groups``
    (``{"*.bias": "none"}``, name pattern -> spec, before the spec's own groups) and
    ``start_step`` say the same as keywords. ``aggregate`` (auto, gather, two_phase)
    overrides how non-summable payloads are aggregated. ``diagnose`` also computes
    the exact mean gradient each reduction (an extra fp32 all-reduce, reported apart
    from ``bytes_wire``) for ``grad_rel_error``/``grad_cos_sim``. ``capture`` (a
    ``gradzip.capture.Capture``) records each bucket as it is communicated (DDP and
    FSDP2); the handle's ``close`` closes it.

    HSDP (``hsdp.py``): an FSDP2 model sharded over the shard dimension of a 2-D mesh
    (``fully_shard(mesh=mesh["shard"])``) with ``replicate_group=mesh.get_group(
    "replicate")`` is reduced across that group by gradzip, in FSDP2's all-reduce hook.
    ``spec`` is then the replicate (inter-node) link's codec, the shard link running
    ``none``, or a dict naming each: ``{"replicate": SPEC, "shard": SPEC}``.

    Hierarchical DDP: ``node_size`` ranks per node (consecutive ranks, as torchrun lays
    them out) reduce each bucket within the node uncompressed, compress only between
    nodes, then share within the node (``gradzip.aggregation.hierarchical``); the
    stats report the ``intra_node`` and ``inter_node`` links.
    """
    from gradzip.comm.auto import is_auto

    if getattr(spec, "kind", None) == "auto":  # a parsed ``AutoMethod``
        spec = spec.options  # type: ignore[union-attr]
    if is_auto(spec):
        return attach_auto(model, spec, process_group=process_group, seed=seed,
                           diagnose=diagnose, nonfinite=nonfinite, groups=groups,
                           start_step=start_step, aggregate=aggregate, capture=capture,
                           replicate_group=replicate_group, node_size=node_size)
    rep_spec, shard_spec = split_spec(spec) if replicate_group is not None else (None, spec)
    built = partial(_built, groups=groups, start_step=start_step, seed=seed,
                    nonfinite=nonfinite, aggregate=aggregate)
    policy, codecs = built(shard_spec)  # SpecError first
    replicate = None if replicate_group is None else (*built(rep_spec), replicate_group)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gradzip.attach needs torch.distributed initialized")
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    _refuse_paths(model, capture=capture is not None, node_size=node_size,
                  replicate=replicate is not None)
    if isinstance(model, DistributedDataParallel):
        handle = apply_ddp(model, policy, codecs, process_group, diagnose, node_size)
    elif isinstance(model, FullyShardedDataParallel):
        handle = apply_fsdp1(model, policy, codecs, process_group, diagnose)
    elif isinstance(model, FSDPModule):
        handle = apply_fsdp2(model, policy, codecs, diagnose, replicate)
    else:
        raise TypeError(
        f"gradzip.attach expects a DistributedDataParallel, fully_shard (FSDP2) or "
            f"FullyShardedDataParallel (FSDP1) model, got {type(model).__name__}"
        )
    if capture is not None:
        apply_capture(handle, model, capture, policy)
    return handle


def attach_auto(model: nn.Module, spec: Any, *, process_group: dist.ProcessGroup | None,
                seed: int, diagnose: bool, nonfinite: str, groups: Any, start_step: Any,
                aggregate: Any, capture: Any, replicate_group: Any, node_size: int) -> Any:
    """``auto`` (``gradzip.comm.auto``) on DDP, flat or hierarchical (``node_size``: the
    candidates compete for the inter-node link), on FSDP2's reduce-scatter, or on HSDP's
    replicate link (``replicate_group``; ``comm.auto_sharded``); what it cannot do is
    refused here, before anything runs."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from gradzip.comm.auto import AutoHandle, AutoOptions, AutoState, auto_hook

    options = AutoOptions.parse(spec)  # an unknown candidate raises first
    refused = [name for name, given in (
        ("groups", groups), ("start_step", start_step), ("aggregate", aggregate),
        ("capture", capture)) if given]
    if refused:
        raise ValueError(f"auto chooses among whole codecs; it does not take "
                         f"{', '.join(refused)} yet: name a codec spec instead")
    if node_size:  # each rank sends a flat chunk between nodes
        refuse_flat([Codec.from_spec(c) for c in options.candidates], "hierarchical DDP")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gradzip.attach needs torch.distributed initialized")
    _refuse_paths(model, capture=False, node_size=node_size,
                  replicate=replicate_group is not None)
    if isinstance(model, FSDPModule):
        from gradzip.comm.auto_sharded import attach_sharded

        return attach_sharded(model, options, seed=seed, nonfinite=nonfinite,
                              diagnose=diagnose, replicate_group=replicate_group)
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"auto runs on DistributedDataParallel and fully_shard (FSDP2) "
                         f"models, not {type(model).__name__}: attach a codec spec (e.g. "
                         "'int8') to FSDP1")
    group = process_group if process_group is not None else model.process_group
    start = START_ITERATION_STATIC_GRAPH if model.static_graph else START_ITERATION
    state = AutoState(options, group, seed=seed, nonfinite=nonfinite, diagnose=diagnose,
                      start_iteration=start, node_size=node_size)
    model.register_comm_hook(state, auto_hook)
    return AutoHandle(state)


def _built(spec: Any, *, groups: dict[str, str] | None, start_step: int | None, seed: int,
           nonfinite: str, aggregate: str | None) -> tuple[Policy, list[Codec]]:
    """The policy of ``spec`` (with the keyword groups and start step) and this rank's
    codec of each of its groups."""
    policy = _policy_of(spec).with_overrides(groups, start_step)
    options = {} if aggregate is None else {"aggregate": aggregate}
    return policy, [build_codec(c, seed=seed, nonfinite=nonfinite, **options)
                    for c in policy.codecs]


def _refuse_paths(model: nn.Module, *, capture: bool, node_size: int,
                  replicate: bool) -> None:
    """Options the model's wrapper cannot honour: a clear error, before anything runs."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if capture and isinstance(model, FullyShardedDataParallel):
        raise ValueError("capture works with DDP and FSDP2 (fully_shard), not FSDP1")
    if isinstance(model, DistributedDataParallel) and getattr(
            model, "_use_python_reducer", False):
        raise ValueError(
            "gradzip cannot attach to a DDP model built with compiled autograd's Python "
            "reducer (torch._dynamo.config.optimize_ddp = 'python_reducer'): that mode "
            "calls the comm hook once per parameter inside the compiled graph, and "
            "gradzip's hooks reduce whole buckets with host work. Build the model with "
            "the default optimize_ddp (plain torch.compile of a DDP model keeps gradzip's "
            "hooks eager and exact)")
    if node_size and not isinstance(model, DistributedDataParallel):
        raise ValueError("node_size= is hierarchical DDP; for FSDP2 across nodes shard "
                         "over mesh[\"shard\"] and pass replicate_group (HSDP)")
    if replicate and not isinstance(model, FSDPModule):
        raise ValueError("replicate_group= is HSDP on FSDP2: shard the model with "
                         "fully_shard(mesh=mesh[\"shard\"]) and pass "
                         "mesh.get_group(\"replicate\")")


def apply_capture(handle: Handle, model: nn.Module, capture: Any, policy: Policy) -> None:
    """Hand every reduction of ``handle`` to ``capture`` (this rank's pack series)."""
    capture.start(dist.get_rank(), codec=str(policy))
    handle.capture = capture
    if handle._ddp_state is not None:
        handle._ddp_state.capture = capture
        module = cast(nn.Module, model.module)
        handle._ddp_state.names = {id(p): n for n, p in module.named_parameters()}
    for rs in handle.reduce_scatters:
        rs.capture = capture


def _policy_of(spec: Any) -> Policy:
    """The codec policy ``attach`` was given: a spec, a JSON policy, a ``Policy``, a
    ``Codec`` or a parsed ``CodecMethod`` (whose codecs are not parsed again)."""
    from gradzip.comm.method import CodecMethod, TorchHookMethod

    if isinstance(spec, CodecMethod):
        return spec.policy
    if isinstance(spec, TorchHookMethod) or (isinstance(spec, str)
                                             and spec.strip().startswith("torch:")):
        raise ValueError(f"{spec} is PyTorch's own DDP comm hook: register it on the DDP "
                         "model (gradzip.comm.torch_hooks.attach_torch measures it), not "
                         "with gradzip.attach")
    return Policy.parse(spec)


def _group_map(policy: Policy, named: list[tuple[str, nn.Parameter]]) -> dict[int, int]:
    """Parameter identity -> policy group, for parameters outside the default."""
    return {id(p): g for name, p in named if (g := policy.group_of(name))}


def apply_ddp(model: Any, policy: Policy, codecs: list[Codec],
              process_group: dist.ProcessGroup | None, diagnose: bool,
              node_size: int = 0) -> Handle:
    """A comm hook on every bucket; groups by parameter; compression from the start step;
    with ``node_size``, compressed between nodes only."""
    if node_size:
        refuse_flat(codecs, "hierarchical DDP")  # each rank reduces a flat chunk
    group = process_group if process_group is not None else model.process_group
    start = START_ITERATION_STATIC_GRAPH if model.static_graph else START_ITERATION
    state = DDPCommState(codecs[0], group, diagnose=diagnose,
                         start_iteration=max(start, policy.start_step),
                         group_codecs=codecs[1:],
                         groups=_group_map(policy, list(model.module.named_parameters())),
                         node_size=node_size)
    model.register_comm_hook(state, gradzip_hook)
    return Handle("ddp", codecs, state.stats, policy, ddp_state=state)


def refuse_flat(codecs: list[Codec], path: str) -> None:
    """A codec that compresses only matrices would send FSDP's flat shards uncompressed."""
    for codec in codecs:
        for _, comp in codec.compressors:
            if comp.needs_matrices:
                raise SpecError(
                    f"'{comp.name}' compresses gradient matrices, but {path} hands gradzip "
                    "a flat shard (FSDP) or chunk (hierarchical DDP) of the gradient, which "
                    "it would send uncompressed; use it with plain DDP, or pick a codec "
                    "that works "
                    "on flat tensors, e.g. 'ef | topk(ratio=0.01)' or 'qsgd'")


def apply_fsdp1(model: Any, policy: Policy, codecs: list[Codec],
                process_group: dist.ProcessGroup | None, diagnose: bool) -> Handle:
    """FSDP1's one comm hook for all units (one codec: it cannot tell parameters apart)."""
    if policy.groups or policy.start_step:
        raise SpecError("per-parameter groups and start_step need DDP or FSDP2; FSDP1 "
                        "runs one comm hook over flat parameters of every unit")
    refuse_flat(codecs, "FSDP1")
    stats = CommStats()
    group = process_group if process_group is not None else model.process_group
    fstate = FSDP1CommState(Reducer(codecs[0], stats, diagnose), group)
    model.register_comm_hook(fstate, fsdp1_hook)
    return Handle("fsdp1", codecs, stats, policy)


def apply_fsdp2(model: nn.Module, policy: Policy, codecs: list[Codec], diagnose: bool,
                replicate: tuple[Policy, list[Codec], dist.ProcessGroup] | None = None
                ) -> Handle:
    """A compressed reduce-scatter per ``fully_shard`` unit, with its group's codec; with
    ``replicate`` (HSDP) also the replicate reduction in each unit's all-reduce hook."""
    from torch.distributed.fsdp import FSDPModule

    used = {policy.group_of(name) for name, _ in model.named_parameters()}
    refuse_flat([codecs[g] for g in sorted(used)], "FSDP2")
    stats = CommStats()
    link = "shard" if replicate is not None else ""
    reducers = [Reducer(c, stats, diagnose, link=link) for c in codecs]
    end = AtBackwardEnd()  # one read of every unit's flags (both links) per backward
    comms = CommCache(end=end)
    timings = EventTimings()  # device times of the reductions on a GPU
    stats.add_settler(timings.settle)
    for reducer in reducers:
        reducer.timings = timings
    names = {id(p): name for name, p in model.named_parameters()}
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    refuse_native_hsdp([cast(nn.Module, unit) for _, unit in units])
    scatters, native = [], set()
    for index, (name, unit) in enumerate(units):
        module = cast(nn.Module, unit)
        params = [names[id(p)] for p in unit_parameters(module)]
        g = unit_group(policy, name, params)
        if replicate is not None and sends_plain(codecs[g]):
            native.add(index)  # HSDP's shard link uncompressed: FSDP2's own reduce-scatter
            continue
        rs = CompressedReduceScatter(reducers[g], comms, key=f"fsdp2/{index}",
                                     start_step=policy.start_step, shapes=shard_shapes(module),
                                     index=index, names=params)
        rs.params = unit_parameters(module)
        scatters.append(rs)
        try:
            unit.set_custom_reduce_scatter(rs)
        except ValueError as e:
            raise ValueError(
                f"cannot compress FSDP2 module {name or '<root>'!r}: {e} "
                "Use one param group per fully_shard call (no per-parameter "
                "shard_placement_fn mesh), or wrap those parameters separately."
            ) from e
    handle = Handle("fsdp2", codecs, stats, policy)
    handle.reduce_scatters = scatters
    if replicate is not None:
        apply_replicate(handle, units, names, replicate, diagnose, native, end, timings)
    return handle


def refuse_native_hsdp(units: list[nn.Module]) -> None:
    """Native HSDP runs FSDP2's own replicate all-reduce: uncompressed and uncounted, so
    a ratio gradzip reported would leave out the slow link."""
    if any(native_hsdp(unit) for unit in units):
        raise ValueError(
            "this FSDP2 model replicates over a 2-D mesh (native HSDP): FSDP2's own "
            "all-reduce across the replicate dimension would cross the inter-node link "
            "uncompressed and uncounted. Shard it with fully_shard(mesh=mesh[\"shard\"]) "
            "and pass replicate_group=mesh.get_group(\"replicate\") to gradzip.attach, "
            "which then compresses the replicate link with the spec")


def apply_replicate(handle: Handle, units: list[tuple[str, Any]], names: dict[int, str],
                    replicate: tuple[Policy, list[Codec], dist.ProcessGroup],
                    diagnose: bool, native: Collection[int] = (),
                    end: AtBackwardEnd | None = None,
                    timings: EventTimings | None = None) -> None:
    """HSDP: each unit's all-reduce hook averages its shard over the replicate group
    through that link's codec (``hsdp.ReplicateReduce``), counted as link "replicate";
    the units in ``native`` reduce-scatter with FSDP2's own collective, which the hook
    counts as link "shard" (``hsdp.NativeShard``)."""
    policy, codecs, group = replicate
    reducers = [Reducer(c, handle.stats, diagnose, link="replicate") for c in codecs]
    comm = TorchCommunicator(group)
    backend = backend_model(dist.get_backend())
    # one end-of-backward read and one event clock for both links' reductions
    on_device = OnDevice(end=end or AtBackwardEnd(), timings=timings or EventTimings())
    if timings is None:
        handle.stats.add_settler(on_device.timings.settle)
    comm.deferred = on_device.end.checks.watch  # flags read when backward ends
    for reducer in reducers:
        reducer.timings = on_device.timings
    for index, (name, unit) in enumerate(units):
        module = cast(nn.Module, unit)
        params = [names[id(p)] for p in unit_parameters(module)]
        g = unit_group(policy, name, params)
        hook = ReplicateReduce(
            reducers[g], comm, key=f"hsdp/{index}", start_step=policy.start_step,
            shapes=shard_shapes(module),
            native=NativeShard(_shard_world(module, group), backend) if index in native
            else None,
            on_device=on_device, chained=chainable(codecs[g]) and not diagnose,
            shards=_agreeing_shards(module, codecs[g]))
        hook.params = unit_parameters(module)
        unit.set_all_reduce_hook(hook)
    handle.replicate_codecs = codecs
    handle.replicate_policy = policy


def _shard_world(unit: nn.Module, replicate: dist.ProcessGroup) -> int:
    """The ranks a unit reduce-scatters over (the world over the replicate group's
    where FSDP2's state does not say)."""
    group = shard_group(unit)
    return (dist.get_world_size(group) if group is not None
            else dist.get_world_size() // dist.get_world_size(replicate))


def _agreeing_shards(unit: nn.Module, codec: Codec) -> Any:
    """The unit's shard group where a non-finite shard must be agreed before the
    replicate reduction (``hsdp.spread_nonfinite``): under 'error', with several
    shards; else None."""
    group = shard_group(unit)
    if codec.nonfinite != "error" or group is None or dist.get_world_size(group) < 2:
        return None
    return group


def unit_group(policy: Policy, unit: str, params: list[str]) -> int:
    """The one policy group of an FSDP2 unit's parameters (reduced in one flat shard)."""
    found = {policy.group_of(n) for n in params} or {0}
    if len(found) > 1:
        by = {g: [n for n in params if policy.group_of(n) == g] for g in sorted(found)}
        raise SpecError(
            f"FSDP2 unit {unit or '<root>'!r} reduces its parameters in one flat shard, "
            f"but the policy gives them different codecs: {by}; wrap the parameters of "
            "each group in their own fully_shard call, or change the patterns")
    return found.pop()

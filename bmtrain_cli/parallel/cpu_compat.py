"""Fill the gaps that keep fleet's hybrid-parallel code from running on the CPU (gloo) build of Paddle.

Applied only when Paddle has no GPU (``apply_if_cpu``); on a GPU build nothing here runs and fleet stays
stock. Each patch replaces one low-level piece and nothing above it, so the same fleet layers, pipeline
schedule and optimizers run in the CPU tests as on GPUs:

* ``ProcessGroupGloo`` has no ``*_on_calc_stream`` collectives (fleet's mp ops and pipeline p2p call
  them): map each to the synchronous gloo call.
* ``ParallelEnv._device_id`` is unset on CPU (PipelineLayer reads it): default it to 0.
* ``c_identity``/``c_concat``/``c_split``/``c_softmax_with_cross_entropy`` (and the ``c_identity`` in the
  backward of ``mp_allreduce``) have no CPU kernels: PyLayer versions over gloo collectives.
* TensorParallel broadcasts its inputs with a device assertion ("Only support xpu, gpu and
  custom_device"): broadcast over the model-parallel group on CPU instead.
* Several ``new_group`` calls in 4+ processes hang on gloo unless a barrier follows each one, and a new
  gloo group of all 3+ ranks often fails to connect: such a group reuses the default group's connections.
* Gloo pairs a send with a recv by a per-group sequence number, but pipeline p2p runs on the whole pipe
  group, where with 3+ stages the ranks make different numbers of calls (stage 1 talks to 0 and 2, stage
  2 only to 1): the numbers drift and the first send waits forever. Route the pipe group's send/recv
  through a 2-rank group per adjacent pair of stages (both sides see every call of the pair in order).
* Pipeline p2p under tensor parallel sends 1/mp of each activation per rank and all-gathers the rest
  (``send_partial``/``recv_partial``/``all_gather_partial``), which gloo does not implement: send whole
  tensors instead (fleet's own ``enable_partial_send_recv: false`` path; every mp rank holds them whole).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bmtrain_cli.machine import gpu_available

_APPLIED = False

# (method on calc stream, synchronous method) pairs; the sync method takes the same arguments + sync_op.
_CALC_STREAM_METHODS = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "reduce",
    "send_partial",
    "recv_partial",
    "all_gather_partial",
)


def apply_if_cpu() -> bool:
    """Apply the compatibility layer when Paddle runs without a GPU. Returns True when it is active."""
    if gpu_available():
        return False
    apply()
    return True


def apply() -> None:
    """Install every patch (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _patch_calc_stream()
    _patch_device_id()
    _patch_mp_ops()
    _patch_tensor_parallel_inputs()
    _patch_new_group()
    _patch_partial_p2p()
    _patch_pipeline_pairs()
    _APPLIED = True


# --------------------------------------------------------------------------- process group methods


def _sync_variant(name: str) -> Any:
    def method(self: Any, *args: Any) -> Any:
        task = getattr(self, name)(*args, True)
        task.wait()
        return task

    method.__name__ = f"{name}_on_calc_stream"
    return method


def _patch_calc_stream() -> None:
    from paddle.base import core

    cls = core.ProcessGroupGloo
    for name in _CALC_STREAM_METHODS:
        if hasattr(cls, name):
            setattr(cls, f"{name}_on_calc_stream", _sync_variant(name))


def _patch_device_id() -> None:
    from paddle.distributed import parallel

    original = parallel.ParallelEnv.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if not hasattr(self, "_device_id"):
            self._device_id = 0

    parallel.ParallelEnv.__init__ = init  # type: ignore[method-assign]  # a patch of Paddle's class


def _patch_partial_p2p() -> None:
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    original = p2p.initialize_p2p_groups

    @functools.wraps(original)
    def initialize_p2p_groups(hcg: Any, enable_partial_send_recv: bool = True, *args: Any, **kw: Any) -> Any:
        return original(hcg, False, *args, **kw)

    p2p.initialize_p2p_groups = initialize_p2p_groups
    p2p._enable_partial_send_recv = False


class _PairRoutedProcessGroup:
    """The pipe group's process group with point-to-point calls sent through 2-rank groups (see module
    doc); everything else (collectives over all stages) goes to the pipe group's own process group."""

    _P2P = ("send", "recv", "send_on_calc_stream", "recv_on_calc_stream")

    def __init__(self, base: Any, ranks: List[int], pairs: Any) -> None:
        self._base, self._ranks, self._pairs = base, list(ranks), pairs  # pairs: {peer global rank: Group}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._base, name)
        if name not in self._P2P:
            return attr

        def routed(tensor: Any, peer: int, *args: Any) -> Any:
            pair = self._pairs.get(self._ranks[peer])
            if pair is None:
                return attr(tensor, peer, *args)
            return getattr(pair.process_group, name)(tensor, pair.get_group_rank(self._ranks[peer]), *args)

        return routed


def _route_pipeline_p2p(hcg: Any) -> None:
    import paddle.distributed as dist

    if getattr(hcg, "_bmt_pairs_routed", False) or hcg._pp_degree <= 2:
        return
    me, pairs = hcg.global_rank, {}
    for ranks in hcg._topo.get_comm_list("pipe"):
        for a, b in zip(ranks[:-1], ranks[1:]):
            group = dist.new_group([a, b])  # every rank creates every pair group, in the same order
            if me == a:
                pairs[b] = group
            elif me == b:
                pairs[a] = group
    pipe = hcg._pp_comm_group
    pipe._pg = _PairRoutedProcessGroup(pipe.process_group, pipe.ranks, pairs)
    hcg._bmt_pairs_routed = True


def _patch_pipeline_pairs() -> None:
    from paddle.distributed.fleet.base import topology

    for name in ("HybridCommunicateGroup", "EPHybridCommunicateGroup"):
        cls = getattr(topology, name, None)
        if cls is None or "__init__" not in cls.__dict__:
            continue
        original = cls.__init__

        def init(self: Any, *args: Any, _original: Any = original, **kw: Any) -> None:
            _original(self, *args, **kw)
            _route_pipeline_p2p(self)

        cls.__init__ = functools.wraps(original)(init)


def _world_alias_group(collective: Any) -> Any:
    """A group of every rank over the default group's gloo connections. Creating a gloo group of 3+
    ranks often fails on these machines (``Connection refused`` / ``TIMEOUT`` in ProcessGroupGloo.create,
    e.g. fleet's pipe and check groups of a pp3/pp4 run); the default group already connects the same
    ranks, and every rank issues the calls on both in the same order (pipeline p2p goes through 2-rank
    groups, see ``_route_pipeline_p2p``)."""
    from paddle.distributed.communication.group import Group, _add_new_group

    default = collective._get_default_group()
    gid = collective._new_ring_id()  # same id sequence as the stock new_group on every rank
    name = collective._default_group_name + str(gid)
    group = Group(default.rank, gid, list(default.ranks), pg=default.process_group, name=name)
    collective._group_map_by_name[name] = group
    collective._group_map[gid] = group
    collective._group_map_backend[group] = collective._group_map_backend.get(default, "gloo")
    _add_new_group(group)
    return group


def _patch_new_group() -> None:
    import paddle.distributed as dist
    from paddle.distributed import collective

    original = collective.new_group

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        ranks = kwargs.get("ranks", args[0] if args else None)
        world = collective._get_global_env().world_size
        if ranks is not None and world > 2 and sorted(ranks) == list(range(world)):
            return _world_alias_group(collective)
        group = original(*args, **kwargs)
        if world > 1:
            dist.barrier()
        return group

    collective.new_group = new_group
    dist.new_group = new_group
    # fleet's topology imported the name before us
    from paddle.distributed.fleet.base import topology

    if hasattr(topology, "new_group"):
        topology.new_group = new_group
    if hasattr(topology, "paddle") and hasattr(topology.paddle.distributed, "new_group"):
        topology.paddle.distributed.new_group = new_group


# --------------------------------------------------------------------------- model-parallel ops


def _group_or_default(group: Optional[Any]) -> Any:
    from paddle.distributed import collective

    return collective._get_default_group() if group is None else group


def _all_reduce(x: Any, group: Any, op: Any = None) -> Any:
    import paddle.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return x


def _all_gather_last(x: Any, group: Any) -> Any:
    import paddle
    import paddle.distributed as dist

    parts: List[Any] = []
    dist.all_gather(parts, x.contiguous() if hasattr(x, "contiguous") else x, group=group)
    return paddle.concat(parts, axis=-1)


def _slice_last(x: Any, rank: int, nranks: int) -> Any:
    size = x.shape[-1] // nranks
    return x[..., rank * size : (rank + 1) * size].clone()


def _build_pylayers() -> Any:
    import paddle
    from paddle.autograd import PyLayer

    class Identity(PyLayer):
        """Forward identity, backward all-reduce (c_identity)."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            ctx.group = group
            return x.clone()

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            return _all_reduce(dy.clone(), ctx.group)

    class AllReduce(PyLayer):
        """Forward all-reduce, backward identity (mp_allreduce)."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            return _all_reduce(x.clone(), group)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            return dy.clone()

    class Concat(PyLayer):
        """Forward all-gather along the last axis, backward keep this rank's slice (c_concat)."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            ctx.rank, ctx.nranks = group.rank, group.nranks
            return _all_gather_last(x, group)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            return _slice_last(dy, ctx.rank, ctx.nranks)

    class Split(PyLayer):
        """Forward keep this rank's slice of the last axis, backward all-gather (c_split)."""

        @staticmethod
        def forward(ctx: Any, x: Any, group: Any) -> Any:
            ctx.group = group
            return _slice_last(x, group.rank, group.nranks)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            return _all_gather_last(dy, ctx.group)

    class VocabCrossEntropy(PyLayer):
        """Softmax cross entropy over a vocabulary split across the group (c_softmax_with_cross_entropy).

        logits [..., V/n] (this rank's vocabulary slice), label [..., 1] global ids; returns loss
        [..., 1], zero where label == ignore_index.
        """

        @staticmethod
        def forward(ctx: Any, logits: Any, label: Any, group: Any, ignore_index: int) -> Any:
            import paddle.distributed as dist

            part = logits.shape[-1]
            start = group.rank * part
            x = logits.astype("float32")
            gmax = x.max(axis=-1, keepdim=True)
            _all_reduce(gmax, group, dist.ReduceOp.MAX)
            shifted = x - gmax
            exp = paddle.exp(shifted)
            sumexp = exp.sum(axis=-1, keepdim=True)
            _all_reduce(sumexp, group)
            lab = label.astype("int64")
            valid = lab != ignore_index
            local = (lab >= start) & (lab < start + part) & valid
            idx = paddle.where(local, lab - start, paddle.zeros_like(lab))
            picked = paddle.take_along_axis(shifted, idx, axis=-1) * local.astype("float32")
            _all_reduce(picked, group)
            validf = valid.astype("float32")
            loss = (paddle.log(sumexp) - picked) * validf
            softmax = exp / sumexp
            ctx.save_for_backward(softmax, idx, local, validf)
            ctx.dtype = logits.dtype
            return loss.astype(logits.dtype)

        @staticmethod
        def backward(ctx: Any, dloss: Any) -> Any:
            softmax, idx, local, validf = ctx.saved_tensor()
            onehot = paddle.nn.functional.one_hot(idx.squeeze(-1), softmax.shape[-1]).astype("float32")
            onehot = onehot * local.astype("float32")
            grad = (softmax - onehot) * (dloss.astype("float32") * validf)
            return grad.astype(ctx.dtype), None

    return Identity, AllReduce, Concat, Split, VocabCrossEntropy


def _patch_mp_ops() -> None:
    from paddle.distributed.fleet.layers.mpu import mp_ops

    Identity, AllReduce, Concat, Split, VocabCrossEntropy = _build_pylayers()

    def c_identity(tensor: Any, group: Any = None, skip_c_identity_dynamic: bool = False) -> Any:
        group = _group_or_default(group)
        if not group.is_member():
            return None
        if skip_c_identity_dynamic:
            return tensor
        return Identity.apply(tensor, group)

    def c_concat(tensor: Any, group: Any = None) -> Any:
        group = _group_or_default(group)
        if not group.is_member():
            return None
        return Concat.apply(tensor, group)

    def c_split(tensor: Any, group: Any = None) -> Any:
        group = _group_or_default(group)
        if not group.is_member():
            return None
        return Split.apply(tensor, group)

    def mp_allreduce(
        tensor: Any,
        op: Any = None,
        group: Any = None,
        use_calc_stream: bool = True,
        use_model_parallel: bool = True,
        skip_c_identity_dynamic: bool = False,
    ) -> Any:
        group = _group_or_default(group)
        if not group.is_member():
            return None
        return AllReduce.apply(tensor, group)

    def c_softmax_with_cross_entropy(
        logits: Any,
        label: Any,
        group: Any = None,
        return_softmax: bool = False,
        ignore_index: int = -100,
    ) -> Any:
        import paddle

        group = _group_or_default(group)
        if not group.is_member():
            return None
        if len(label.shape) == len(logits.shape) - 1:
            label = paddle.unsqueeze(label, axis=-1)
        loss = VocabCrossEntropy.apply(logits, label, group, ignore_index)
        if return_softmax:
            raise NotImplementedError("return_softmax is not supported by the CPU compatibility layer")
        return loss

    mp_ops._c_identity = c_identity
    mp_ops._c_concat = c_concat
    mp_ops._c_split = c_split
    mp_ops._mp_allreduce = mp_allreduce
    mp_ops._c_softmax_with_cross_entropy = c_softmax_with_cross_entropy


def _patch_tensor_parallel_inputs() -> None:
    from paddle.distributed.fleet.meta_parallel import tensor_parallel

    def broadcast_input_data(hcg: Any, *inputs: Any, **kwargs: Any) -> Any:
        import paddle
        import paddle.distributed as dist

        group = hcg.get_model_parallel_group()
        src = hcg.get_model_parallel_group_src_rank()

        def one(x: Any) -> Any:
            if isinstance(x, paddle.Tensor):
                dist.broadcast(x, src=src, group=group)
                return x
            if isinstance(x, dict):
                return {k: one(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(one(v) for v in x)
            return x

        return one(tuple(inputs)), one(dict(kwargs))

    tensor_parallel.broadcast_input_data = broadcast_input_data


def pair_groups(ranks: Sequence[int]) -> Dict[Tuple[int, int], Any]:
    """A process group for every pair (i < j) of members of ``ranks`` (collective: every rank creates every
    group, in the same order, with a barrier after each), for :func:`all_to_all_rows`: gloo matches a send
    to a receive by a counter of its group's operations, so the pairs of an exchange must not share one."""
    import paddle.distributed as dist

    groups: Dict[Tuple[int, int], Any] = {}
    for i in range(len(ranks)):
        for j in range(i + 1, len(ranks)):
            groups[(i, j)] = dist.new_group([ranks[i], ranks[j]])
            dist.barrier()
    return groups


def all_to_all_rows(
    x: Any,
    send: Sequence[int],
    recv: Sequence[int],
    ranks: Sequence[int],
    me: int,
    pairs: Dict[Tuple[int, int], Any],
) -> Any:
    """gloo's missing all-to-all of rows (``alltoall_single`` with split sizes), exactly: ``x`` holds
    ``send[d]`` rows for group member d, one after the other; the result holds ``recv[s]`` rows from each
    member s, in member order. Pairwise blocking send/recv, each pair in its own group (``pairs``, from
    :func:`pair_groups`): every pair (i < j) exchanges in one global order, the lower rank sending first, so
    the earliest unfinished pair always has both ranks waiting on it (no deadlock); empty pieces are not
    sent (both sides know the sizes)."""
    import paddle
    import paddle.distributed as dist

    starts = [sum(send[:d]) for d in range(len(send))]
    pieces: List[Any] = []
    for s, n in enumerate(recv):
        if s == me:
            pieces.append(x[starts[me] : starts[me] + n])
        else:
            pieces.append(paddle.empty([n, *x.shape[1:]], x.dtype))
    for i in range(len(ranks)):
        for j in range(i + 1, len(ranks)):
            if me not in (i, j):
                continue
            peer, group = (j if me == i else i), pairs[(i, j)]
            out = x[starts[peer] : starts[peer] + send[peer]]
            steps = [("send", out, send[peer]), ("recv", pieces[peer], recv[peer])]
            for kind, t, n in steps if me == i else steps[::-1]:
                if n == 0:
                    continue
                if kind == "send":
                    dist.send(t.contiguous(), dst=ranks[peer], group=group)
                else:
                    dist.recv(t, src=ranks[peer], group=group)
    return paddle.concat(pieces) if pieces else x[:0]

"""Expert parallel: the routed experts of every MoE layer split over the N ranks of an expert group.

Layout: the expert groups are carved out of fleet's data axis (``dp_degree = data_parallel x
expert_parallel``): consecutive data ranks form an expert group, so every rank still reads its own data.
Rank r of a group holds experts [r E/N, (r+1) E/N) of each MoE layer (their single-process names are kept:
``mlp.experts.{e}``); the router, attention, norms, embeddings and shared experts are whole on every rank.

Forward of a sparse layer (models/moe.py hands its rows, sorted by expert, to :func:`dispatch`): the group
all-gathers its per-expert row counts, the rows travel to the ranks owning their experts (an all-to-all),
each rank runs its experts over the rows it received (grouped by expert, whatever their source), and the
results travel back (the reverse all-to-all) to be weighted and summed per token where they came from. The
all-to-all is a PyLayer whose backward is the reverse all-to-all, so the tokens' ranks get their gradients
and the owners their experts' gradients. NCCL's ``alltoall_single`` on a GPU; on the CPU build, where gloo
has none, ``cpu_compat.all_to_all_rows`` (pairwise send/recv in a group per pair, the same rows).

Every rank of a group must run each forward of the split model together. A training step does (each rank
draws the same number of micro-batches); a decoding loop (models/generate.py, GRPO's rollouts and held-out
reward) asks :meth:`ExpertGroup.all_done` each step, which ``shard_experts`` hands the model as its
``decode_in_step``, and a rank whose rows are done runs a dropped one-token forward until every rank is.

A quantised base (QLoRA): each rank reads and quantises only its own experts' weights from the checkpoint
(models.load_pretrained's ``held_experts``), runs them as the quantised grouped calls of quant/experts.py
over the rows it receives, and trains their adapters (when LoRA targets the experts) like a full-precision
expert's.

Gradients (parallel/context.py's convention: the sum over data ranks of each rank's gradient): the
replicated parameters are summed over all the data ranks as in plain data parallel; an expert's gradient,
already the sum over its group's tokens, is summed over its replicas (the ranks of the other expert groups
with the same index). The global gradient norm adds the experts' squares summed over the group to the
replicated parameters' squares, so every expert counts once.

The MoE load-balancing loss needs nothing: transformers computes it per forward from the router logits of
that forward's tokens, and the router is whole on every rank, so each rank's micro-batch gives the value one
process gives for the same micro-batch (under context parallel, each rank's share's sums summed over the
context group first: models/moe.py load_balancing_loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import paddle
from paddle.autograd import PyLayer

EXPERT_ATTR = "is_expert"  # set on the parameters of the experts a rank holds


@dataclass
class ExpertGroup:
    """This rank's expert group: the process group, its global ranks, this rank's index in it, and the
    group of ranks holding the same experts (None without data parallel beside)."""

    group: Any
    ranks: List[int]
    rank: int
    replicas: Any = None
    pairs: Optional[Dict[Tuple[int, int], Any]] = None  # CPU: cpu_compat.pair_groups of the members

    @property
    def degree(self) -> int:
        return len(self.ranks)

    def owned(self, num_experts: int) -> range:
        per = num_experts // self.degree
        return range(self.rank * per, (self.rank + 1) * per)

    def gather_counts(self, counts: Sequence[int]) -> np.ndarray:
        """[degree, experts]: every member's row count per expert."""
        import paddle.distributed as dist

        parts: List[Any] = []
        dist.all_gather(parts, paddle.to_tensor(np.asarray(counts, dtype="int64")), group=self.group)
        return np.stack([p.numpy() for p in parts])

    def all_to_all(self, x: paddle.Tensor, send: Sequence[int], recv: Sequence[int]) -> paddle.Tensor:
        """``send[d]`` rows of ``x`` to member d; ``recv[s]`` rows from member s, in member order."""
        x = x.contiguous()
        if self.pairs is not None:
            from bmtrain_cli.parallel.cpu_compat import all_to_all_rows

            return all_to_all_rows(x, send, recv, self.ranks, self.rank, self.pairs)
        import paddle.distributed as dist

        out = paddle.empty([int(sum(recv)), *x.shape[1:]], x.dtype)
        dist.alltoall_single(out, x, list(send), list(recv), group=self.group)
        return out

    def all_done(self, done: bool) -> bool:
        """Whether every member is ``done`` (collective over the group): a decoding loop on a sharded model
        runs its next step while any member still decodes, so every member runs each step's dispatch."""
        import paddle.distributed as dist

        running = paddle.to_tensor(np.asarray([0 if done else 1], dtype="int64"))
        dist.all_reduce(running, group=self.group)
        return int(running.numpy()[0]) == 0

    def sum_squares(self, squares: paddle.Tensor) -> paddle.Tensor:
        """The experts' squared gradient norm summed over the group (each expert once)."""
        import paddle.distributed as dist

        dist.all_reduce(squares, group=self.group)
        return squares


class _AllToAll(PyLayer):
    @staticmethod
    def forward(
        ctx: Any, x: paddle.Tensor, group: ExpertGroup, send: List[int], recv: List[int]
    ) -> paddle.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return group.all_to_all(x, send, recv)

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> paddle.Tensor:
        return ctx.group.all_to_all(dy, ctx.recv, ctx.send)


def all_to_all(
    x: paddle.Tensor, group: ExpertGroup, send: Sequence[int], recv: Sequence[int]
) -> paddle.Tensor:
    """Differentiable all-to-all of rows: the gradient travels back the reverse way."""
    return _AllToAll.apply(x, group, [int(n) for n in send], [int(n) for n in recv])


def dispatch(
    group: ExpertGroup,
    rows: paddle.Tensor,
    counts: Sequence[int],
    run_local: Callable[[paddle.Tensor, List[int]], paddle.Tensor],
) -> paddle.Tensor:
    """The experts' outputs for ``rows`` (sorted by expert, ``counts[e]`` for each of all E experts), in
    the same order, each row processed by the rank owning its expert: ``run_local(rows, local_counts)``
    runs this rank's experts over rows sorted by local expert (collective over the group)."""
    n, experts = group.degree, len(counts)
    per = experts // n
    table = group.gather_counts(counts)  # [source, expert]
    send = [int(table[group.rank, d * per : (d + 1) * per].sum()) for d in range(n)]
    mine = table[:, group.rank * per : (group.rank + 1) * per]  # [source, local expert]
    recv = [int(x) for x in mine.sum(axis=1)]
    got = all_to_all(rows, group, send, recv)  # by source, then local expert
    starts = np.concatenate([[0], np.cumsum(mine.reshape(-1))[:-1]]).reshape(mine.shape)
    order = np.concatenate(
        [np.arange(starts[s, e], starts[s, e] + mine[s, e]) for e in range(per) for s in range(n)]
        or [np.zeros(0, dtype="int64")]
    ).astype("int64")
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size, dtype="int64")
    done = run_local(paddle.gather(got, paddle.to_tensor(order)), [int(x) for x in mine.sum(axis=0)])
    return all_to_all(paddle.gather(done, paddle.to_tensor(inverse)), group, recv, send)


def expert_group(hcg: Any, degree: int, on_cpu: bool) -> ExpertGroup:
    """This rank's :class:`ExpertGroup`: fleet's data-parallel groups cut into consecutive groups of
    ``degree``, and the replica groups of their members with the same index (every rank creates every
    group, in the same order, with a barrier after each: several gloo groups created back to back hang
    without one)."""
    import paddle.distributed as dist

    me = dist.get_rank()
    mine: Optional[ExpertGroup] = None
    replicas = None
    for data_ranks in hcg.topology().get_comm_list("data"):
        data_ranks = list(data_ranks)
        for i in range(0, len(data_ranks), degree):
            ranks = data_ranks[i : i + degree]
            group = dist.new_group(ranks)
            dist.barrier()
            pairs = None
            if on_cpu:  # gloo has no all-to-all: pairwise exchanges, a group per pair
                from bmtrain_cli.parallel.cpu_compat import pair_groups

                pairs = {(0, 1): group} if degree == 2 else pair_groups(ranks)
            if me in ranks:
                mine = ExpertGroup(group, ranks, ranks.index(me), pairs=pairs)
        if len(data_ranks) > degree:
            for k in range(degree):
                ranks = data_ranks[k::degree]
                group = dist.new_group(ranks)
                dist.barrier()
                if me in ranks:
                    replicas = group
    assert mine is not None  # every rank lies in one data-parallel group
    mine.replicas = replicas
    return mine


def shard_experts(model: Any, group: ExpertGroup) -> str:
    """Keep only this rank's experts in every MoE layer of ``model`` (whole and identical on every rank
    before; a quantised base's other experts read as nothing, quant/layer.HeldElsewhere) and route those
    layers' rows through :func:`dispatch`, and give ``model`` the group's :meth:`ExpertGroup.all_done` as its
    ``decode_in_step`` (models/generate.py); says what this rank holds."""
    from bmtrain_cli.quant.layer import quantized_layers

    total = sum(int(p.size) for p in model.parameters())
    layers, owned = 0, range(0)
    for layer in model.sublayers():
        shard = getattr(layer, "shard_experts", None)
        if shard is None:
            continue
        owned = group.owned(layer.num_experts)
        shard(owned, lambda rows, counts, run, g=group: dispatch(g, rows, counts, run))
        for p in layer.experts.parameters():
            setattr(p, EXPERT_ATTR, True)
            p.no_sync = True  # fleet's start-up broadcast over the data ranks leaves it alone
        for _, q in quantized_layers(layer.experts):  # a quantised base's (QLoRA): codes, no parameters
            setattr(q, EXPERT_ATTR, True)
        layers += 1
    model.decode_in_step = group.all_done  # models/generate.py: every member runs each decoding step
    held = sum(int(p.size) for p in model.parameters())
    return (
        f"expert parallel: rank {group.rank} of {group.degree} holds experts {owned.start}-{owned.stop - 1} "
        f"of each of {layers} MoE layers ({held} of {total} parameters)"
    )


def is_expert(p: Any) -> bool:
    """A parameter (or a quantised layer) of an expert this rank holds."""
    return bool(getattr(p, EXPERT_ATTR, False))


def reduce_expert_gradients(fleet_optimizer: Any, group: ExpertGroup, data_world: int) -> None:
    """Under fleet's hybrid optimizer (tensor or pipeline parallel beside): its data-parallel reduction
    averages gradients that the layout scaled by the data-rank count; it now leaves the experts out, whose
    gradient (already the sum over the group's tokens) is divided by that count and summed over the
    expert's replicas."""
    opt = fleet_optimizer
    while not hasattr(type(opt), "_hybrid_sync_grad"):
        opt = opt._inner_opt
    fleet_sync = opt._hybrid_sync_grad

    def sync(params: List[Any]) -> None:
        import paddle.distributed as dist

        fleet_sync([p for p in params if not is_expert(p)])
        for p in params:
            if is_expert(p) and p.grad is not None:
                p.grad.scale_(1.0 / data_world)
                if group.replicas is not None:
                    dist.all_reduce(p.grad, group=group.replicas)

    opt._hybrid_sync_grad = sync


def global_grad_norm(
    group: ExpertGroup,
    params: Sequence[Any],
    norm: Callable[[Sequence[Any]], Optional[paddle.Tensor]],
) -> Optional[paddle.Tensor]:
    """sqrt(replicated parameters' squares + the group's experts' squares), ``norm`` measuring each part."""
    parts = []
    for mine in (False, True):
        t = norm([p for p in params if is_expert(p) == mine])
        sq = paddle.zeros([], "float32") if t is None else paddle.square(t.astype("float32")).reshape([])
        parts.append(group.sum_squares(sq.reshape([1])).reshape([]) if mine else sq)
    return paddle.sqrt(parts[0] + parts[1])

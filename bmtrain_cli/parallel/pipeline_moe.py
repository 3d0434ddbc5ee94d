"""A mixture of experts' load-balancing loss across pipeline stages (parallel/pipeline.py).

The loss is not a sum over layers: transformers adds up every sparse layer's top-k assignments and router
probabilities per expert (and the counted tokens) first, and takes their product at the end
(models/moe.py). So when ``output_router_logits`` adds it to the training loss, the pipeline items carry
those running sums from stage to stage as one more tensor [3, experts] (assignments, probabilities, tokens
in every column) beside the hidden state: the embedding starts it at zero, each sparse decoder layer adds
its own, the final norm hands it on with the normed hidden state, and the loss on the last stage adds
``router_aux_loss_coef x aux x tokens`` to the micro-batch's summed cross entropy (x pairs to a pipeline
objective's summed pair losses, preference/pipeline.py), as the single process's ``loss_sum`` does. The probabilities' gradient travels back with the hidden state's, to the routers of
every stage. Additions start from an exact zero and run in layer order: the value is the single process's.
Under context parallel each rank's items carry the sums of its share of the rows, and the last stage sums
them over the context group (a sum whose gradient reaches every rank's routers) before the product.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import paddle

from bmtrain_cli.models.moe import adds_aux_loss, balance_loss, stacked_router_sums, token_mask
from bmtrain_cli.parallel.ring_attention import local_indices


def start_sums(arch: Any) -> List[paddle.Tensor]:
    """What the embedding item adds to its output: [zeros [3, experts]], or nothing."""
    return [paddle.zeros([3, arch.num_experts], "float32")] if adds_aux_loss(arch) else []


def add_layer_sums(layer: Any, mask: Any, sums: List[paddle.Tensor], core: Any = None) -> List[paddle.Tensor]:
    """``sums`` plus the sparse decoder ``layer``'s part from its last forward (``mask``: the rows'
    attention mask, 0 = padding; ``core``: the context group's attention core under context parallel,
    where the layer routed this rank's share of the rows, whose mask columns are taken)."""
    if not sums or not layer.sparse:
        return sums
    if core is not None:
        ring = core.ring
        idx = local_indices(mask.shape[1], ring.degree, ring.rank)
        mask = paddle.gather(mask, paddle.to_tensor(idx), axis=1)
    mlp = layer.mlp
    return [sums[0] + stacked_router_sums(mlp.router_logits, mlp.num_experts, mlp.top_k, token_mask(mask))]


def split_sums(out: Any) -> Tuple[Any, List[Any]]:
    """(hidden state or logits, the carried sums) of an item's output (a tensor, or a tuple ending with them)."""
    if isinstance(out, (tuple, list)):
        return out[0], list(out[1:])
    return out, []


def join_sums(out: Any, sums: List[Any]) -> Any:
    """An item's output: ``out`` alone, or followed by the carried sums."""
    return (out, *sums) if sums else out


def with_aux(
    loss_sum: Any, count: Any, sums: List[paddle.Tensor], arch: Any, record: List[Any], ring: Any = None
) -> Any:
    """The micro-batch's summed loss with ``router_aux_loss_coef x aux x count`` added (aux from the last
    stage's ``sums``, appended to ``record`` for the log; ``loss_sum`` itself without them). ``ring``: the
    context group, over which the shares' sums are summed first (``count``: this rank's share's)."""
    if not sums:
        return loss_sum
    aux = balance_loss(sums[0] if ring is None else ring.sum(sums[0]), arch.num_experts)
    record.append(aux.detach())
    return loss_sum + arch.router_aux_loss_coef * aux * count

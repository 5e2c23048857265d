"""``co.planner.measure_costs``: a :class:`~ckpt_offload.planner.costs.CostModel` measured from the
user's step, run three times -- a warm-up, once instrumented for bytes (``recorder.py``), once timed
(``timing.py``) -- and the host link measured unless given."""

from __future__ import annotations

import torch

from ckpt_offload.planner.costs import Bandwidth, CostModel
from ckpt_offload.planner.recorder import measure_bytes
from ckpt_offload.planner.timing import measure_bandwidth, measure_times

__all__ = ["measure_costs"]


def measure_costs(
    step, named_blocks, device: str = "cpu", bandwidth: Bandwidth | None = None, min_bytes: int = 0
) -> CostModel:
    """Measures a :class:`CostModel` for ``step`` (one forward + backward) over ``named_blocks``
    (``[(name, module), ...]`` in execution order). Runs the step three times: a warm-up, one
    instrumented for bytes, one timed; the last also gives the baseline step time.

    Example::

        cm = measure_costs(lambda: model(x).sum().backward(), list(model.layers.named_children()))
    """
    step()  # warm-up: gradients exist, lazy initialisation done, allocator warm
    recs, pre_b, post_b, calls, call_order = measure_bytes(step, named_blocks, device, min_bytes)
    fwd, bwd, pre_s, mid_s, post_s, total = measure_times(step, named_blocks, device)
    if len(fwd) != len(calls):  # the step ran its blocks differently the second time: no per-call times
        f1 = {i: f for i, f in enumerate(fwd)}
        fwd = [f1.get(c, 0.0) for c in range(len(calls))]
        bwd = [bwd[c] if c < len(bwd) else 2.0 * fwd[c] for c in range(len(calls))]
    for r, f, b in zip(calls, fwd, bwd):
        c = r.cost
        c.forward_s, c.backward_s = f, b
        c.selective_recompute_s = f * r._fraction_dropped
    blocks = []
    for i, r in enumerate(recs):
        c = r.cost
        mine = [k for k, b in enumerate(call_order) if b == i]
        c.forward_s = sum(fwd[k] for k in mine)
        c.backward_s = sum(bwd[k] for k in mine)
        c.selective_recompute_s = c.forward_s * r._fraction_dropped
        blocks.append(c)
    in_order = call_order == list(range(len(recs)))
    if bandwidth is None:
        bandwidth = measure_bandwidth(device, (32 << 20) if device == "cuda" else (2 << 20))
    bw = bandwidth
    rng = torch.get_rng_state().nbytes if device == "cpu" else 0
    return CostModel(
        blocks=blocks,
        bandwidth=bw,
        min_bytes=min_bytes,
        pre_bytes=pre_b,
        post_bytes=post_b,
        pre_s=pre_s,
        mid_s=mid_s,
        post_s=post_s,
        baseline_step_s=total,
        device=device,
        checkpoint_bytes=rng,
        call_order=[] if in_order else call_order,
        call_blocks=[] if in_order else [r.cost for r in calls],
    )

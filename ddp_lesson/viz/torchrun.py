"""What torchrun starts on each node (notebook 00): the agents, the workers, their ranks."""
from __future__ import annotations

from .style import SMALL_PT, finish, subplots

__all__ = ["torchrun_topology_figure"]


def torchrun_topology_figure(nnodes: int = 2, nproc_per_node: int = 4, figsize=(11, 4.6)):
    """torchrun -> agents -> workers -> process group, on ``nnodes`` x ``nproc_per_node``.

    One torchrun per node starts its *agent* (``LocalElasticAgent``), which starts and watches
    the node's workers. The agents meet at ``--rdzv-endpoint``; the workers'
    ``init_process_group`` at the store ``MASTER_ADDR:MASTER_PORT``. Each worker box shows
    ``RANK`` (``node * nproc_per_node + local_rank``) and ``LOCAL_RANK``. Sources: torch 2.13,
    ``torch/distributed/run.py``, ``elastic/agent/server/local_elastic_agent.py``.

    Returns:
        The ``Figure``; worker texts have gid ``"worker{RANK}"``, agents ``"agent{node}"``.
    """
    from matplotlib.patches import FancyBboxPatch

    fig, ax = subplots(figsize=figsize)
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.axis("off")

    def box(x, y, w, h, text, colour, gid=None, **kw):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.3,rounding_size=1",
                                    facecolor=colour, edgecolor="grey", linewidth=0.8))
        t = ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=SMALL_PT, **kw)
        if gid:
            t.set_gid(gid)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->",
                                                                 "color": "grey"})

    box(30, 88, 40, 9, "rendezvous endpoint (--rdzv-endpoint, c10d):\nthe agents meet here",
        "#eeeeee")
    node_w = 96 / nnodes
    worker_w = (node_w - 4) / nproc_per_node
    for node in range(nnodes):
        x0 = 2 + node * node_w
        ax.add_patch(FancyBboxPatch((x0, 20), node_w - 2, 62, boxstyle="round,pad=0.3",
                                    facecolor="none", edgecolor="#999999", linestyle="--"))
        ax.text(x0 + 1, 79, f"node {node} (GROUP_RANK={node})", ha="left", va="center",
                fontsize=SMALL_PT, fontweight="bold")
        box(x0 + 6, 62, node_w - 14, 11,
            f"torchrun --nnodes {nnodes} --nproc-per-node {nproc_per_node}\n"
            "agent: starts and watches the workers", "#fde3cf", gid=f"agent{node}")
        arrow(x0 + node_w / 2 - 1, 74, 50, 87)
        for lr in range(nproc_per_node):
            rank = node * nproc_per_node + lr
            wx = x0 + 1 + lr * worker_w
            box(wx + 0.5, 30, worker_w - 2, 18, f"worker\nRANK {rank}\nLOCAL_RANK {lr}",
                "#dbe9f6", gid=f"worker{rank}")
            arrow(x0 + node_w / 2 - 1, 61, wx + worker_w / 2 - 0.5, 49)
            arrow(wx + worker_w / 2 - 0.5, 29, wx + worker_w / 2 - 0.5, 13)
    world = nnodes * nproc_per_node
    box(2, 3, 94, 9, f"process group: WORLD_SIZE={world} ranks (init_process_group meets at "
        "the store MASTER_ADDR:MASTER_PORT), then all_reduce, ...", "#e2f0d9")
    return finish(fig)

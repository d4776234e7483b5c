"""The links between pipeline ranks the event simulator times transfers on."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    latency_s: float = 0.0
    bandwidth: float | None = None  # bytes/s; None: no bandwidth limit

    def busy_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth if self.bandwidth else 0.0


@dataclass(frozen=True)
class Network:
    """Links between ranks: ``intra`` inside a node of ``ranks_per_node`` consecutive ranks,
    ``inter`` across nodes (``ranks_per_node`` 0: one node).  ``links`` overrides single
    directed pairs."""

    intra: Link = Link()
    inter: Link | None = None
    ranks_per_node: int = 0
    links: dict = field(default_factory=dict)  # {(src, dst): Link}

    def link(self, src: int, dst: int) -> Link:
        if (src, dst) in self.links:
            return self.links[(src, dst)]
        same_node = not self.ranks_per_node or src // self.ranks_per_node == dst // self.ranks_per_node
        return self.intra if same_node or self.inter is None else self.inter

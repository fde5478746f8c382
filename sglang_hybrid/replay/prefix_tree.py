"""Token radix tree shared by all simulated policies: the KV side of the cache, unbounded.

Every request's prompt+output is inserted after it is served, so `match` gives the longest
prefix (LCP) of a prompt whose KV any earlier request left behind. Edges are stored as raw int32
bytes so a whole edge is compared with one memcmp; numpy locates the mismatch only on the one
edge where the prompt leaves the tree.

Policies attach recurrent-state checkpoints to node *ends* (as SGLang does). A split keeps the
original node object as the deeper half and puts a new node above it, so a checkpoint recorded
on a node (policies key their own dicts by node) stays at the same depth forever; nodes are never
deleted because KV is never evicted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ITEM = np.dtype(np.int32).itemsize


class Node:
    __slots__ = ("parent", "children", "edge", "depth")

    def __init__(self, parent: Node | None, edge: bytes, depth: int):
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.edge = edge  # int32 token bytes from the parent's end to this node's end
        self.depth = depth  # tokens from the root to this node's end

    @property
    def start_depth(self) -> int:
        return self.depth - len(self.edge) // _ITEM

    def first_token(self) -> int:
        return int.from_bytes(self.edge[:_ITEM], "little", signed=True)

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, len={len(self.edge) // _ITEM}, children={len(self.children)})"


@dataclass
class MatchView:
    """What one prompt finds in the tree before it is served (the tree state it was scheduled against).

    `path` holds the nodes fully inside the matched prefix, root excluded, shallowest first;
    `lcp` is the matched length in tokens. `splits_edge` tells whether the prompt leaves the tree
    in the middle of an edge, i.e. inserting it creates a new branch node at depth `lcp`.
    """

    lcp: int
    path: list[Node]
    splits_edge: bool


def _mismatch(edge: bytes, tokens: np.ndarray, start: int, length: int) -> int:
    """Index of the first differing token among the first `length` of edge vs tokens[start:]."""
    a = np.frombuffer(edge, dtype=np.int32, count=length)
    diff = np.flatnonzero(a != tokens[start : start + length])
    return int(diff[0]) if diff.size else length


class PrefixTree:
    def __init__(self) -> None:
        self.root = Node(None, b"", 0)
        self.total_tokens = 0  # distinct token positions held (the oracle's state count)

    def match(self, tokens: np.ndarray) -> MatchView:
        data = tokens.tobytes()
        n = len(tokens)
        node, depth, path = self.root, 0, []
        while depth < n:
            child = node.children.get(int(tokens[depth]))
            if child is None:
                return MatchView(depth, path, splits_edge=False)
            edge = child.edge
            length = len(edge) // _ITEM
            if length <= n - depth and data[depth * _ITEM : (depth + length) * _ITEM] == edge:
                path.append(child)
                node, depth = child, depth + length
                continue
            k = _mismatch(edge, tokens, depth, min(length, n - depth))
            return MatchView(depth + k, path, splits_edge=k < length)
        return MatchView(depth, path, splits_edge=False)

    def _split(self, node: Node, offset: int) -> Node:
        """Put a new node above `node` holding the first `offset` tokens of its edge; return it."""
        cut = offset * _ITEM
        parent = node.parent
        upper = Node(parent, node.edge[:cut], node.start_depth + offset)
        parent.children[upper.first_token()] = upper
        node.edge = node.edge[cut:]
        node.parent = upper
        upper.children[node.first_token()] = node
        return upper

    def insert(self, tokens: np.ndarray) -> None:
        data = tokens.tobytes()
        n = len(tokens)
        node, depth = self.root, 0
        while depth < n:
            child = node.children.get(int(tokens[depth]))
            if child is None:
                leaf = Node(node, data[depth * _ITEM :], n)
                node.children[int(tokens[depth])] = leaf
                self.total_tokens += n - depth
                return
            edge = child.edge
            length = len(edge) // _ITEM
            if length <= n - depth and data[depth * _ITEM : (depth + length) * _ITEM] == edge:
                node, depth = child, depth + length
                continue
            k = _mismatch(edge, tokens, depth, min(length, n - depth))
            node, depth = self._split(child, k), depth + k

    def node_ending_at(self, tokens: np.ndarray, depth: int) -> Node:
        """The node whose end is exactly `depth` along `tokens` (already inserted), splitting if needed."""
        if not 0 < depth <= len(tokens):
            raise ValueError(f"depth {depth} outside 1..{len(tokens)}")
        node, at = self.root, 0
        while True:
            child = node.children.get(int(tokens[at]))
            if child is None:
                raise KeyError(f"tokens[:{depth}] are not in the tree")
            if child.depth == depth:
                return child
            if child.depth > depth:
                return self._split(child, depth - at)
            node, at = child, child.depth

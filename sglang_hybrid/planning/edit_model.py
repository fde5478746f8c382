"""The online edit model: which addresses named the restore point of a session's past edits."""

from __future__ import annotations

from typing import Optional, Sequence

from sglang_hybrid.planning.addresses import Address, AnchorIndex, Prefill


class EditModel:
    """Addresses of past edit points, scored by how often each named the restore point of the
    edits that followed.

    An address's share is its running frequency over the edits of sequences it names a point
    of: a rule that applies only to some sequences (masking, once more observations than the
    window hold) is not worn down by the edits of the others. Among the addresses naming a
    point (those that named it already in the request that computed it, if any did: one naming
    it only just before the edit, the n-th message from the end when a condensing agent's view
    is full, names it too late for a checkpoint there), an edit's credit goes to those with the
    highest share, split among them if they tie: descriptions that have always agreed share
    it, and once one has been right alone it takes the credit of the points they name
    together. An address right only when it coincides with the session's rule (the first
    answer counted from the start, when every edit re-renders the last answer) so keeps no
    share of its own, which it would predict where the two disagree; several rules mixing in
    one session -- a masked observation on tool turns, a re-rendered answer on user turns --
    each keep the probability of the edits only they name.
    """

    def __init__(self, capacity: int, learning_rate: float):
        self.capacity = capacity
        self.learning_rate = learning_rate
        # Address -> running frequency with which it named the checkpoint an edit would
        # restore from: the deepest point at or before the edit among all addresses scored.
        self.shares: dict[Address, float] = {}

    def observe(self, index: AnchorIndex, edit_point: int, prior: Optional["EditModel"],
                prefills: Sequence[Prefill] = ()) -> None:
        """Learn from one edit: the request diverged from the sequence ``index`` describes at
        ``edit_point``. ``prefills``: what the session's latest requests computed, oldest
        first."""
        reached = {address: index.position_of(address) for address in self.shares}
        usable = [depth for depth in reached.values() if depth is not None and depth <= edit_point]
        best = max(usable, default=None)
        winners = [address for address, depth in reached.items() if best is not None and depth == best]
        # A checkpoint at the point could only be taken by the latest request that computed
        # it: of the addresses naming the point, those that named it (or foresaw it) then.
        computed_by = None if best is None else next(
            (prefill.index for prefill in reversed(prefills) if prefill.restored < best <= prefill.length), None)
        if computed_by is not None:
            winners = [address for address in winners if computed_by.names(address, best)] or winners
        top = max((self.shares[address] for address in winners), default=None)
        credited = [address for address in winners if self.shares[address] == top]
        for address, share in self.shares.items():
            if reached[address] is None:
                continue  # named no point of this sequence: it predicted nothing, right or wrong
            target = 1.0 / len(credited) if address in credited else 0.0
            self.shares[address] = share + self.learning_rate * (target - share)
        new = [address for address in index.addresses_of(edit_point) if address not in self.shares]
        for address in new:
            # A description of the edit just seen has predicted nothing yet: it starts at the
            # stream-wide share of that description, else at zero, so shares stay frequencies
            # (summing to at most one) and a description earns weight only by predicting.
            self.shares[address] = prior.shares.get(address, 0.0) if prior is not None else 0.0
        excess = len(self.shares) - self.capacity
        if excess > 0:
            # The descriptions just added have not competed yet: drop the weakest of the others
            # (the oldest first among equals).
            veterans = [address for address in self.shares if address not in new]
            weakest = sorted(range(len(veterans)), key=lambda i: (self.shares[veterans[i]], i))[:excess]
            for i in weakest:
                del self.shares[veterans[i]]

    def predict(
        self, index: AnchorIndex, limit: int, prior: Optional["EditModel"] = None, prior_weight: float = 0.0
    ) -> dict[int, float]:
        """Depth -> probability that the next edit restores from a checkpoint there, for the
        ``limit`` most likely depths, evaluated on ``index``.

        With a ``prior`` the shares are ``prior_weight`` parts the prior's to one part this
        model's: a session that has shown one edit rule may still follow another the stream
        shows (a rewritten answer on every call as well as a moved block on user turns).
        A window address also predicts the points it will name in the requests after the
        next (``AnchorIndex.positions_ahead``), its share spread over the requests until then:
        a checkpoint held that long for one restore is worth that share of one the next
        request restores from.
        """
        predictions: dict[int, float] = {}
        mine = 1.0 / (1.0 + prior_weight) if prior is not None else 1.0
        sources = [(self.shares, mine)]
        if prior is not None:
            sources.append((prior.shares, 1.0 - mine))
        for shares, weight in sources:
            for address, share in shares.items():
                if share <= 0.0:
                    continue
                for depth, requests in index.points_named(address, limit):
                    if depth > 0:
                        predictions[depth] = predictions.get(depth, 0.0) + weight * share / requests
        ranked = sorted(predictions.items(), key=lambda item: (-item[1], item[0]))[:limit]
        return {depth: min(probability, 1.0) for depth, probability in ranked}

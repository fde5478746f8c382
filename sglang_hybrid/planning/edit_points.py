"""EditPoints: where a session's next request is expected to restore from after an edit,
learned online from where the session's and the stream's past edits did (docs/architecture.md,
"Planning quantities")."""

from __future__ import annotations

from typing import Optional

from sglang_hybrid.planning.addresses import AnchorIndex
from sglang_hybrid.planning.edit_model import EditModel
from sglang_hybrid.planning.state import PRIOR_EDITS, Session, StreamStats
from sglang_hybrid.planning.session_rates import append_probability, edit_probability


class EditPoints:
    """The stream's edit models -- one over all edits, the prior of sessions with little
    history, and one per ending of the output before the edit -- and the predictions read
    from them with a session's own (``Session.model``, ``Session.models_after``)."""

    def __init__(self, *, predictions_per_request: int, model_capacity: int, learning_rate: float):
        self.predictions_per_request = predictions_per_request
        self._model_capacity = model_capacity
        self._learning_rate = learning_rate
        self.stream_model = self._new_model()
        self.stream_models_after: dict[int, EditModel] = {}

    def learn(self, session: Session, restorable: int, ending: Optional[int]) -> None:
        """``session``'s new request edited the sequence ``session.index`` describes and can
        restore at most from ``restorable``; the output before it ended with ``ending`` (None:
        not known). Credited alike in the models over all edits and in those after that ending."""
        if session.model is None:
            session.model = self._new_model()
        learners = [(session.model, self.stream_model)]
        if ending is not None:
            if ending not in self.stream_models_after:
                self.stream_models_after[ending] = self._new_model()
            if ending not in session.models_after:
                session.models_after[ending] = self._new_model()
            learners.append((session.models_after[ending], self.stream_models_after[ending]))
        for own, stream in learners:
            own.observe(session.index, restorable, stream, session.prefills)
            stream.observe(session.index, restorable, None, session.prefills)

    def planned(self, session: Session, stream: StreamStats, index: AnchorIndex) -> dict[int, float]:
        """Depth -> P(the request after the one ``index`` describes restores there), over any
        request: where its edits land x P(it edits)."""
        predicted = self._predicted(session.model, self.stream_model, session.edits, index)
        edit = edit_probability(session, stream)
        return {depth: probability * edit for depth, probability in predicted.items()}

    def after_output(self, session: Session, stream: StreamStats) -> dict[int, float]:
        """``session.predictions`` once its latest output's ending is known: at each depth,
        P(the next request restores there | that ending) (the edits after such endings x
        P(edit | ending)) or its probability over any request, as planned, whichever is
        higher. After a tool call the result comes below the re-rendered call; after an answer
        a user turn may move a block below it; the point the ending does not name may still
        come later (the user turn ending a chain of tool calls)."""
        ending = session.ending
        stream_after = self.stream_models_after.get(ending)
        if stream_after is None:
            return session.predictions
        predicted = self._predicted(session.models_after.get(ending), stream_after, session.edits_after[ending],
                                    session.index)
        edit = 1.0 - append_probability(session, stream)
        merged = dict(session.predictions)
        for depth, probability in predicted.items():
            merged[depth] = max(merged.get(depth, 0.0), probability * edit)
        return merged

    def _predicted(self, own: Optional[EditModel], stream: EditModel, own_edits: int,
                   index: AnchorIndex) -> dict[int, float]:
        """Depth -> P(an edit restores there) on ``index``: by the session's model (``own``,
        from ``own_edits`` edits), the stream's rule weighing as PRIOR_EDITS of them, or by
        the stream's alone."""
        if own is None:
            return stream.predict(index, self.predictions_per_request)
        return own.predict(index, self.predictions_per_request, stream, PRIOR_EDITS / own_edits)

    def _new_model(self) -> EditModel:
        return EditModel(self._model_capacity, self._learning_rate)

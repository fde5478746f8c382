"""Semantic anchors: token positions where agent frameworks edit prompt history.

An anchor at position ``p`` names the recurrent state after consuming tokens ``[0, p)``, so a
``MESSAGE_START`` anchor is the index of the message's first special token: a checkpoint taken
there survives any edit of that message or of anything after it.

Detection works from token ids alone. Every family marks message structure with special
tokens that sit in one contiguous id range, so the hot path is a single vectorized comparison
over the ids; all further work happens on the few special-token positions it finds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Mapping, Sequence

import numba
import numpy as np

from sglang_hybrid.anchors import special_tokens as tok
from sglang_hybrid.tokens import positions_at_least

logger = logging.getLogger(__name__)


class AnchorKind(IntEnum):
    SYSTEM_END = 0
    MESSAGE_START = 1
    TOOL_RESULT_START = 2
    ASSISTANT_START = 3
    REASONING_START = 4
    REASONING_END = 5
    PROMPT_END = 6
    GENERATION_END = 7

    @property
    def label(self) -> str:
        return self.name.lower()


class Role(IntEnum):
    """Role of the message an anchor belongs to; NONE for anchors that are not message starts."""

    NONE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4
    OTHER = 5  # a structural block with no chat role, e.g. Mistral's [AVAILABLE_TOOLS]

    @property
    def label(self) -> str | None:
        return None if self is Role.NONE else self.name.lower()


@dataclass(frozen=True)
class Anchor:
    position: int
    kind: AnchorKind
    role: str | None = None


@dataclass(frozen=True, eq=False)
class Anchors:
    """Detected anchors as parallel arrays sorted by (position, kind).

    Several kinds may share a position (a system block's end is the next message's start).
    """

    positions: np.ndarray  # int64
    kinds: np.ndarray  # int8, AnchorKind values
    roles: np.ndarray  # int8, Role values

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def to_list(self) -> list[Anchor]:
        return [
            Anchor(int(p), AnchorKind(int(k)), Role(int(r)).label)
            for p, k, r in zip(self.positions, self.kinds, self.roles)
        ]

    def of_kind(self, kind: AnchorKind) -> np.ndarray:
        # Compared as an int: numpy converts an IntEnum operand at ~2.5 us a call.
        return self.positions[self.kinds == int(kind)]

    def last_at_or_before(self, position: int) -> int | None:
        """The deepest anchor position <= ``position`` (where a restore could start), or None."""
        index = int(np.searchsorted(self.positions, position, side="right")) - 1
        return int(self.positions[index]) if index >= 0 else None


def _empty() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


class _Collector:
    """Accumulates (positions, kind, roles) groups and sorts them once at the end."""

    def __init__(self) -> None:
        self._positions: list[np.ndarray] = []
        self._kinds: list[np.ndarray] = []
        self._roles: list[np.ndarray] = []

    def add(self, positions: np.ndarray, kind: AnchorKind, roles: np.ndarray | Role = Role.NONE) -> None:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size == 0:
            return
        self._positions.append(positions)
        self._kinds.append(np.full(positions.shape, int(kind), dtype=np.int8))
        if isinstance(roles, Role):
            self._roles.append(np.full(positions.shape, int(roles), dtype=np.int8))
        else:
            self._roles.append(np.asarray(roles, dtype=np.int8))

    def build(self) -> Anchors:
        positions = np.concatenate(self._positions)
        kinds = np.concatenate(self._kinds)
        roles = np.concatenate(self._roles)
        order = np.lexsort((kinds, positions))
        return Anchors(positions[order], kinds[order], roles[order])


def _add_ends(out: _Collector, prompt_len: int, total: int) -> None:
    out.add(np.array([prompt_len]), AnchorKind.PROMPT_END)
    if total > prompt_len:
        out.add(np.array([total]), AnchorKind.GENERATION_END)


class _Grammar:
    """Where one template family puts its anchors, given the positions of its special tokens."""

    family: str
    # Half-open id range holding every special token the grammar looks at.
    special_lo: int
    special_hi: int

    def detect(self, ids: np.ndarray, prompt_len: int) -> Anchors:
        """Every anchor of ``ids``, a prompt of ``prompt_len`` tokens and the output after it."""
        if self.special_lo == 0:
            pos = np.flatnonzero(ids < self.special_hi)
            toks = ids[pos]
        else:
            pos = positions_at_least(ids, self.special_lo)
            toks = ids[pos]
            in_range = toks < self.special_hi
            if not in_range.all():
                pos, toks = pos[in_range], toks[in_range]
        out = _Collector()
        self.find(ids, pos, toks, out)
        _add_ends(out, prompt_len, int(ids.shape[0]))
        return out.build()

    def find(self, ids: np.ndarray, pos: np.ndarray, toks: np.ndarray, out: _Collector) -> None:
        """Add the anchors of ``ids`` given its special tokens ``toks`` at ``pos``."""
        raise NotImplementedError


def _next_token(ids: np.ndarray, pos: np.ndarray, offset: int) -> np.ndarray:
    """ids[pos + offset], with -1 past the end (a message header cut off by the prompt end)."""
    index = pos + offset
    last = ids.shape[0] - 1
    return np.where(index <= last, ids[np.minimum(index, last)], -1)


def _as_ids(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(token_ids)
    # An empty Python list becomes a float array; keep every id array integral.
    return ids if ids.dtype.kind in "iu" else ids.astype(np.int64)


def _first_after(sorted_candidates: np.ndarray, pos: int) -> int | None:
    index = int(np.searchsorted(sorted_candidates, pos, side="right"))
    return int(sorted_candidates[index]) if index < sorted_candidates.shape[0] else None


class _ChatMLGrammar(_Grammar):
    """``<|im_start|>{role}\\n ... <|im_end|>\\n``; Qwen tool results are user messages whose
    content is one or more ``<tool_response>`` blocks. The family of every Qwen hybrid model,
    read on every request's prompt: detected by ``_chatml_anchors``, compiled, where the
    other grammars' ~40 array operations cost ~70 us on any prompt (a 100-message prompt of
    8k tokens: 14 us instead of 71; of 128k: 44 instead of 162, most of it finding the
    special tokens, ``tokens.positions_at_least``)."""

    def __init__(self, family: str, special_ids: Mapping[str, int], role_ids: Mapping[str, int], newline_id: int):
        self.family = family
        self.special_lo = min(special_ids.values())
        self.special_hi = max(special_ids.values()) + 1
        self._tokens = np.array([special_ids[name] for name in _CHATML_TOKENS] + [newline_id], dtype=np.int64)
        # Role word id -> role; a word listed twice counts as the later role.
        roles = {token: int(Role[name.upper()]) for name, token in role_ids.items()}
        self._role_words = np.array(list(roles), dtype=np.int64)
        self._roles = np.array(list(roles.values()), dtype=np.int8)

    def detect(self, ids: np.ndarray, prompt_len: int) -> Anchors:
        if ids.dtype != np.int32 and ids.dtype != np.int64:
            ids = ids.astype(np.int64)
        return Anchors(*_chatml_anchors(ids, positions_at_least(ids, self.special_lo), prompt_len, self.special_hi,
                                        self._tokens, self._role_words, self._roles))


_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_response>", "<think>", "</think>")
_IM_START, _IM_END, _TOOL_RESPONSE, _THINK, _END_THINK, _NEWLINE = range(6)  # in _ChatMLGrammar._tokens


# The kinds and roles ``_chatml_anchors`` places, as the plain ints compiled code reads.
_ASSISTANT_START = int(AnchorKind.ASSISTANT_START)
_GENERATION_END = int(AnchorKind.GENERATION_END)
_MESSAGE_START = int(AnchorKind.MESSAGE_START)
_PROMPT_END = int(AnchorKind.PROMPT_END)
_REASONING_END = int(AnchorKind.REASONING_END)
_REASONING_START = int(AnchorKind.REASONING_START)
_ROLE_ASSISTANT = int(Role.ASSISTANT)
_ROLE_NONE = int(Role.NONE)
_ROLE_OTHER = int(Role.OTHER)
_ROLE_SYSTEM = int(Role.SYSTEM)
_ROLE_TOOL = int(Role.TOOL)
_ROLE_USER = int(Role.USER)
_SYSTEM_END = int(AnchorKind.SYSTEM_END)
_TOOL_RESULT_START = int(AnchorKind.TOOL_RESULT_START)


@numba.njit([f"Tuple((i8[:], i1[:], i1[:]))({ids}[:], i8[:], i8, i8, i8[:], i8[:], i1[:])" for ids in ("i8", "i4")],
            cache=True)
def _chatml_anchors(ids, candidates, prompt_len, special_hi, tokens, role_words, roles):
    """(positions, kinds, roles) of the anchors of ``ids`` (a prompt of ``prompt_len`` tokens,
    then the output) by (position, kind), from the positions of its ids past the special
    range's start (``candidates``, ascending; those past its end are skipped):

    * a message start at each ``<|im_start|>``, its role from the role word after it (a user
      message whose content opens with ``<tool_response>`` is a tool result); the assistant's
      content starts after "<|im_start|>assistant\\n", the newline merged into "\\n\\n" when
      the content starts with one (then the anchor sits one token early);
    * a tool result start at each ``<tool_response>``, reasoning around ``<think>`` ...
      ``</think>``;
    * the system prompt's end after the ``<|im_end|>`` (and newline) closing the first
      message, if that is a system message;
    * the prompt's end, and the generation's if there is an output."""
    n = ids.shape[0]
    # A special token places at most two anchors (a message start, its content's start).
    capacity = 2 * candidates.shape[0] + 2
    positions = np.empty(capacity, dtype=np.int64)
    kinds = np.empty(capacity, dtype=np.int8)
    anchor_roles = np.empty(capacity, dtype=np.int8)
    count = 0
    first_role = -1  # of the first message; -2 once the system prompt's end is placed
    for i in candidates:
        token = ids[i]
        if token >= special_hi:
            continue
        if token == tokens[_IM_START]:
            word = ids[i + 1] if i + 1 < n else -1
            role = _ROLE_OTHER
            for j in range(role_words.shape[0]):
                if word == role_words[j]:
                    role = roles[j]
            if role == _ROLE_USER and i + 3 < n and ids[i + 3] == tokens[_TOOL_RESPONSE]:
                role = _ROLE_TOOL
            if first_role == -1:
                first_role = role
            positions[count], kinds[count], anchor_roles[count] = i, _MESSAGE_START, role
            count += 1
            if role == _ROLE_ASSISTANT:
                header = 3 if i + 2 < n and ids[i + 2] == tokens[_NEWLINE] else 2
                positions[count] = min(i + header, n)
                kinds[count], anchor_roles[count] = _ASSISTANT_START, _ROLE_ASSISTANT
                count += 1
        elif token == tokens[_TOOL_RESPONSE]:
            positions[count], kinds[count], anchor_roles[count] = i, _TOOL_RESULT_START, _ROLE_TOOL
            count += 1
        elif token == tokens[_THINK]:
            positions[count], kinds[count], anchor_roles[count] = i, _REASONING_START, _ROLE_NONE
            count += 1
        elif token == tokens[_END_THINK]:
            positions[count], kinds[count], anchor_roles[count] = i + 1, _REASONING_END, _ROLE_NONE
            count += 1
        elif token == tokens[_IM_END] and first_role == _ROLE_SYSTEM:
            first_role = -2
            positions[count] = i + 2 if i + 1 < n and ids[i + 1] == tokens[_NEWLINE] else i + 1
            kinds[count], anchor_roles[count] = _SYSTEM_END, _ROLE_SYSTEM
            count += 1
    positions[count], kinds[count], anchor_roles[count] = prompt_len, _PROMPT_END, _ROLE_NONE
    count += 1
    if n > prompt_len:
        positions[count], kinds[count], anchor_roles[count] = n, _GENERATION_END, _ROLE_NONE
        count += 1
    # By position, then kind (kinds are below 8), as placed among equals.
    order = np.argsort(positions[:count] * 8 + kinds[:count], kind="mergesort")
    return positions[order], kinds[order], anchor_roles[order]


class _Llama3Grammar(_Grammar):
    """``<|start_header_id|>{role}<|end_header_id|>\\n\\n ... <|eot_id|>``; tool results use the
    ``ipython`` header (any role other than system/user/assistant counts as a tool result)."""

    family = "llama3"
    special_lo, special_hi = tok.LLAMA3_SPECIAL_RANGE

    def __init__(self):
        ids = tok.LLAMA3_SPECIAL_IDS
        self.start_header = ids["<|start_header_id|>"]
        self.eot = ids["<|eot_id|>"]
        self.role_ids = {Role[name.upper()]: token for name, token in tok.LLAMA3_ROLE_IDS.items()}

    def find(self, ids, pos, toks, out):
        n = ids.shape[0]
        starts = pos[toks == self.start_header]
        role_tok = _next_token(ids, starts, 1)
        roles = np.full(starts.shape, int(Role.TOOL), dtype=np.int8)
        for role, token in self.role_ids.items():
            roles[role_tok == token] = int(role)
        out.add(starts, AnchorKind.MESSAGE_START, roles)
        out.add(starts[roles == Role.TOOL], AnchorKind.TOOL_RESULT_START, Role.TOOL)

        # "<|start_header_id|>assistant<|end_header_id|>\n\n": the role word is one token.
        assistant = starts[roles == Role.ASSISTANT]
        header_len = 3 + (_next_token(ids, assistant, 3) == tok.LLAMA3_DOUBLE_NEWLINE_ID)
        out.add(np.minimum(assistant + header_len, n), AnchorKind.ASSISTANT_START, Role.ASSISTANT)

        if starts.size and roles[0] == Role.SYSTEM:
            end = _first_after(pos[toks == self.eot], int(starts[0]))
            if end is not None:
                out.add(np.array([end + 1]), AnchorKind.SYSTEM_END, Role.SYSTEM)


class _DeepSeekGrammar(_Grammar):
    """``<BOS>{system}<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>``, tool outputs in
    ``<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...`` blocks after which the assistant
    continues without a new ``<｜Assistant｜>`` token."""

    def __init__(self, family: str, special_ids: Mapping[str, int]):
        self.family = family
        self.user = special_ids["<｜User｜>"]
        self.assistant = special_ids["<｜Assistant｜>"]
        self.outputs_begin = special_ids["<｜tool▁outputs▁begin｜>"]
        self.outputs_end = special_ids["<｜tool▁outputs▁end｜>"]
        self.output_begin = special_ids["<｜tool▁output▁begin｜>"]
        self.think = special_ids["<think>"]
        self.end_think = special_ids["</think>"]
        self.special_lo, self.special_hi = tok.DEEPSEEK_V3_SPECIAL_RANGE

    def find(self, ids, pos, toks, out):
        n = ids.shape[0]
        users = pos[toks == self.user]
        assistants = pos[toks == self.assistant]
        outputs = pos[toks == self.outputs_begin]
        out.add(users, AnchorKind.MESSAGE_START, Role.USER)
        out.add(assistants, AnchorKind.MESSAGE_START, Role.ASSISTANT)
        out.add(outputs, AnchorKind.MESSAGE_START, Role.TOOL)
        out.add(pos[toks == self.output_begin], AnchorKind.TOOL_RESULT_START, Role.TOOL)
        out.add(np.minimum(assistants + 1, n), AnchorKind.ASSISTANT_START, Role.ASSISTANT)
        out.add(np.minimum(pos[toks == self.outputs_end] + 1, n), AnchorKind.ASSISTANT_START, Role.ASSISTANT)
        out.add(pos[toks == self.think], AnchorKind.REASONING_START)
        out.add(pos[toks == self.end_think] + 1, AnchorKind.REASONING_END)
        # The system prompt is plain text between BOS and the first user turn.
        if users.size and users[0] > 1:
            out.add(users[:1], AnchorKind.SYSTEM_END, Role.SYSTEM)


class _MistralGrammar(_Grammar):
    """``[INST]...[/INST]{answer}</s>``, ``[TOOL_RESULTS]...[/TOOL_RESULTS]``, the tool list in
    ``[AVAILABLE_TOOLS]`` (re-placed before the last user turn), optional ``[SYSTEM_PROMPT]``."""

    def __init__(self, family: str, control_ids: Mapping[str, int]):
        self.family = family
        self.ids = dict(control_ids)
        self.special_lo = 0
        self.special_hi = max(self.ids.values()) + 1

    def _at(self, pos, toks, name: str) -> np.ndarray:
        token = self.ids.get(name)
        return pos[toks == token] if token is not None else _empty()

    def find(self, ids, pos, toks, out):
        n = ids.shape[0]
        out.add(self._at(pos, toks, "[SYSTEM_PROMPT]"), AnchorKind.MESSAGE_START, Role.SYSTEM)
        out.add(self._at(pos, toks, "[AVAILABLE_TOOLS]"), AnchorKind.MESSAGE_START, Role.OTHER)
        out.add(self._at(pos, toks, "[INST]"), AnchorKind.MESSAGE_START, Role.USER)
        tool_results = self._at(pos, toks, "[TOOL_RESULTS]")
        out.add(tool_results, AnchorKind.MESSAGE_START, Role.TOOL)
        out.add(tool_results, AnchorKind.TOOL_RESULT_START, Role.TOOL)
        # The assistant speaks right after a user turn or after tool results.
        for closer in ("[/INST]", "[/TOOL_RESULTS]"):
            out.add(np.minimum(self._at(pos, toks, closer) + 1, n), AnchorKind.ASSISTANT_START, Role.ASSISTANT)
        out.add(self._at(pos, toks, "[THINK]"), AnchorKind.REASONING_START)
        out.add(self._at(pos, toks, "[/THINK]") + 1, AnchorKind.REASONING_END)
        system_end = self._at(pos, toks, "[/SYSTEM_PROMPT]")[:1] + 1
        out.add(system_end, AnchorKind.SYSTEM_END, Role.SYSTEM)


# The furthest after a special token any grammar reads, or places an anchor: Llama 3 reads
# a header's fourth token (a newline or not) and puts the assistant's content after it.
_LOOKAHEAD = 4


def _grammar_for(family: str) -> _Grammar:
    if family in ("chatml", "qwen3"):
        return _ChatMLGrammar("chatml", tok.QWEN3_SPECIAL_IDS, tok.QWEN3_ROLE_IDS, tok.QWEN3_NEWLINE_ID)
    if family == "qwen3_5":
        return _ChatMLGrammar("qwen3_5", tok.QWEN3_5_SPECIAL_IDS, tok.QWEN3_5_ROLE_IDS, tok.QWEN3_5_NEWLINE_ID)
    if family == "llama3":
        return _Llama3Grammar()
    if family in ("deepseek", "deepseek_v3"):
        return _DeepSeekGrammar("deepseek", tok.DEEPSEEK_V3_SPECIAL_IDS)
    if family == "deepseek_v32":
        return _DeepSeekGrammar("deepseek_v32", tok.DEEPSEEK_V32_SPECIAL_IDS)
    if family in ("mistral", "mistral_tekken"):
        return _MistralGrammar("mistral", tok.MISTRAL_TEKKEN_CONTROL_IDS)
    if family == "mistral_spm":
        return _MistralGrammar("mistral_spm", tok.MISTRAL_SPM_CONTROL_IDS)
    raise ValueError(f"unknown template family {family!r}; known: {', '.join(KNOWN_FAMILIES)}")


KNOWN_FAMILIES: tuple[str, ...] = (
    "chatml", "qwen3", "qwen3_5", "llama3", "deepseek", "deepseek_v3", "deepseek_v32",
    "mistral", "mistral_tekken", "mistral_spm",
)  # fmt: skip
NO_ANCHORS = "none"
# ``AnchorDetector.output_ending`` of an output that does not end with a special token.
NO_ENDING = -1

# HF model_type -> (family, vocab sizes the family's ids are valid for). A model type alone is
# not enough: Llama 2 and Llama 3 share "llama", Mistral changed tokenizers under "mistral".
_MODEL_TYPE_FAMILIES: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {
    **{t: (("chatml", (151936, 152064)),) for t in (
        "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next")},
    **{t: (("qwen3_5", (248320,)),) for t in ("qwen3_5", "qwen3_5_moe")},
    "llama": (("llama3", (128256,)),),
    "deepseek_v3": (("deepseek", (129280,)),),
    "deepseek_v32": (("deepseek_v32", (129280,)),),
    **{t: (("mistral_spm", (32768,)), ("mistral", (131072,))) for t in ("mistral", "mixtral")},
}  # fmt: skip


class AnchorDetector:
    """Token ids -> anchors for one chat-template family.

    ``family == "none"`` is the explicit no-template mode: only PROMPT_END and GENERATION_END,
    which need no knowledge of the template.
    """

    def __init__(self, grammar: _Grammar | None):
        self._grammar = grammar
        self.family = grammar.family if grammar is not None else NO_ANCHORS

    @classmethod
    def for_family(cls, name: str) -> "AnchorDetector":
        if name == NO_ANCHORS:
            return cls(None)
        return cls(_grammar_for(name))

    @classmethod
    def for_mistral_tokenizer(cls, tokenizer: Any) -> "AnchorDetector":
        """Detector using the control-token ids of a mistral-common tokenizer."""
        ids = tok.mistral_control_ids(tokenizer)
        if "[INST]" not in ids:
            logger.warning("Mistral tokenizer without [INST] control token; anchor detection off")
            return cls(None)
        return cls(_MistralGrammar("mistral", ids))

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> "AnchorDetector":
        """Pick the family from a tokenizer_config.json dict (by its added tokens) or a model
        config.json dict (by model_type and vocab_size). Anything not recognized exactly gets
        the no-anchors mode, logged: a wrong family would checkpoint at meaningless places."""
        if "added_tokens_decoder" in config:
            family, reason = _family_from_added_tokens(config["added_tokens_decoder"])
        else:
            family, reason = _family_from_model_config(config)
        if family is None:
            logger.warning("anchor detection off (prompt_end/generation_end only): %s", reason)
            return cls(None)
        logger.info("anchor detection: family %s (%s)", family, reason)
        return cls.for_family(family)

    def output_ending(self, covered_output: np.ndarray) -> int:
        """How an output ended: its last token before the end of the turn (``covered_output``
        is the output a finished request's state covers, which stops there) when that is one
        of the template's special tokens -- the close of a tool call (``</tool_call>``,
        ``[/TOOL_CALLS]``...) -- else ``NO_ENDING`` (a plain answer, or no template)."""
        grammar = self._grammar
        if grammar is None or covered_output.shape[0] == 0:
            return NO_ENDING
        last = int(covered_output[-1])
        return last if grammar.special_lo <= last < grammar.special_hi else NO_ENDING

    def detect(self, prompt_ids: Sequence[int] | np.ndarray, output_ids: Sequence[int] | np.ndarray | None = None) -> Anchors:
        """Anchors of ``prompt_ids`` followed by ``output_ids`` (the request's generated tokens).

        Pass numpy integer arrays on hot paths: converting a Python list costs more than the
        detection itself.
        """
        prompt = _as_ids(prompt_ids)
        prompt_len = int(prompt.shape[0])
        if output_ids is None or len(output_ids) == 0:
            ids, total = prompt, prompt_len
        else:
            ids = np.concatenate([prompt, _as_ids(output_ids)])
            total = int(ids.shape[0])

        if self._grammar is not None and total:
            return self._grammar.detect(ids, prompt_len)
        out = _Collector()
        _add_ends(out, prompt_len, total)
        return out.build()

    def detect_continuation(self, prompt_anchors: Anchors, prompt_ids: np.ndarray, output_ids: np.ndarray) -> Anchors:
        """``detect(prompt_ids, output_ids)``, given ``prompt_anchors = detect(prompt_ids)``,
        reading again only the output and the end of the prompt: a finished request's anchors
        cost about what its output's do, not what its whole prompt's do (at 128k tokens and
        ~100 messages, 87 us instead of 192 us; the same at 8k).

        Every anchor but the system prompt's end lies at most ``_LOOKAHEAD`` tokens after the
        special token it comes from, found reading no further. So the prompt's anchors before
        a position with no special token in the ``_LOOKAHEAD`` tokens before it stand, and the
        rest are found in the tokens from there on. The system prompt's end comes from the
        first message: it stands when the prompt's anchors hold it before that position;
        otherwise everything is read again."""
        prompt, output = _as_ids(prompt_ids), _as_ids(output_ids)
        grammar = self._grammar
        starts = prompt_anchors.of_kind(AnchorKind.MESSAGE_START)
        system_end = prompt_anchors.of_kind(AnchorKind.SYSTEM_END)
        if grammar is None or starts.size == 0 or system_end.size == 0:
            return self.detect(prompt, output)
        split = int(starts[-1])
        while split > 0:
            window_start = max(split - _LOOKAHEAD, 0)
            window = prompt[window_start:split]
            special = np.flatnonzero((window >= grammar.special_lo) & (window < grammar.special_hi))
            if special.size == 0:
                break
            split = window_start + int(special[0])
        if int(system_end[0]) >= split:
            return self.detect(prompt, output)
        head = int(np.searchsorted(prompt_anchors.positions, split))
        rest = self.detect(prompt[split:], output)
        system_ends = rest.kinds == int(AnchorKind.SYSTEM_END)
        if system_ends.any():
            rest = _without(rest, ~system_ends)
        return Anchors(np.concatenate([prompt_anchors.positions[:head], rest.positions + split]),
                       np.concatenate([prompt_anchors.kinds[:head], rest.kinds]),
                       np.concatenate([prompt_anchors.roles[:head], rest.roles]))


def _without(anchors: Anchors, keep: np.ndarray) -> Anchors:
    return Anchors(anchors.positions[keep], anchors.kinds[keep], anchors.roles[keep])


def _family_from_added_tokens(added: Mapping[Any, Any]) -> tuple[str | None, str]:
    by_content = {}
    for token_id, entry in added.items():
        content = entry["content"] if isinstance(entry, Mapping) else str(entry)
        by_content[content] = int(token_id)

    def matches(table: Mapping[str, int], names: Sequence[str]) -> bool:
        return all(by_content.get(name) == table[name] for name in names)

    chatml_names = ("<|im_start|>", "<|im_end|>", "<tool_response>", "<think>", "</think>")
    if "<|im_start|>" in by_content:
        if matches(tok.QWEN3_SPECIAL_IDS, chatml_names):
            return "chatml", "Qwen3 special tokens in added_tokens_decoder"
        if matches(tok.QWEN3_5_SPECIAL_IDS, chatml_names):
            return "qwen3_5", "Qwen3.5 special tokens in added_tokens_decoder"
        return None, "ChatML tokens at ids of an unknown vocabulary (role token ids unknown)"
    if "<|start_header_id|>" in by_content:
        if matches(tok.LLAMA3_SPECIAL_IDS, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")):
            return "llama3", "Llama 3 header tokens in added_tokens_decoder"
        return None, "Llama-style header tokens at unexpected ids"
    if "<｜User｜>" in by_content:
        structural = ("<｜User｜>", "<｜Assistant｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>")
        if matches(tok.DEEPSEEK_V3_SPECIAL_IDS, structural + ("<think>", "</think>")):
            return "deepseek", "DeepSeek-V3/R1 special tokens in added_tokens_decoder"
        if matches(tok.DEEPSEEK_V32_SPECIAL_IDS, structural + ("<think>", "</think>")):
            return "deepseek_v32", "DeepSeek-V3.2 special tokens in added_tokens_decoder"
        return None, "DeepSeek-style tokens at unexpected ids"
    if "[INST]" in by_content:
        for family, table in (("mistral", tok.MISTRAL_TEKKEN_CONTROL_IDS), ("mistral_spm", tok.MISTRAL_SPM_CONTROL_IDS)):
            if matches(table, ("[INST]", "[/INST]", "[TOOL_RESULTS]", "[AVAILABLE_TOOLS]")):
                return family, "Mistral control tokens in added_tokens_decoder"
        return None, "Mistral-style control tokens at unexpected ids"
    return None, "no known chat-template special tokens in added_tokens_decoder"


def _family_from_model_config(config: Mapping[str, Any]) -> tuple[str | None, str]:
    # Multimodal wrappers keep the language model's settings in text_config.
    text_config = config.get("text_config") or {}
    model_type = config.get("model_type")
    vocab_size = config.get("vocab_size", text_config.get("vocab_size"))
    candidates = _MODEL_TYPE_FAMILIES.get(model_type) or _MODEL_TYPE_FAMILIES.get(text_config.get("model_type"))
    if not candidates:
        return None, f"model_type {model_type!r} has no known chat-template family"
    for family, vocab_sizes in candidates:
        if vocab_size in vocab_sizes:
            return family, f"model_type {model_type!r}, vocab_size {vocab_size}"
    return None, f"model_type {model_type!r} with vocab_size {vocab_size} matches no known tokenizer"

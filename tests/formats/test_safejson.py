"""``formats.safejson``: the limits every JSON file read from a checkpoint is held to, at their edges.

Nesting: exactly ``max_depth`` levels of arrays or objects load, one more is a ``JsonLimitError`` naming the limit,
and so is every depth between the limit and Python's recursion limit (where only the check after parsing can
see it) and beyond it (where the parser's ``RecursionError`` is turned into the same error). Containers: counted
before parsing as ``{`` and ``[`` alike, so a bomb of empty arrays is refused as one of empty objects is.
"""

from __future__ import annotations

import sys

import pytest

from ckptaudit.formats.io.safejson import MAX_JSON_DEPTH, JsonLimitError, loads_limited

OPEN_CLOSE = {"arrays": ("[", "]"), "objects": ('{"k":', "}"), "mixed": ('[{"k":', "}]")}


def nested(kind: str, depth: int) -> str:
    """``depth`` levels of containers around one number (``mixed``: an array holding an object, repeated)."""
    opening, closing = OPEN_CLOSE[kind]
    per = 2 if kind == "mixed" else 1
    assert depth % per == 0
    return opening * (depth // per) + "1" + closing * (depth // per)


@pytest.mark.parametrize("kind", list(OPEN_CLOSE))
def test_nesting_up_to_the_limit_loads_and_one_more_level_is_refused(kind: str) -> None:
    assert loads_limited(nested(kind, MAX_JSON_DEPTH), "trainer_state.json") is not None
    with pytest.raises(JsonLimitError, match=f"trainer_state.json.*deeper than {MAX_JSON_DEPTH} levels"):
        loads_limited(nested(kind, MAX_JSON_DEPTH + 2), "trainer_state.json")
    with pytest.raises(JsonLimitError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        loads_limited(nested("arrays", MAX_JSON_DEPTH + 1), "trainer_state.json")


@pytest.mark.parametrize("kind", list(OPEN_CLOSE))
def test_depths_the_parser_accepts_are_refused_after_parsing(kind: str) -> None:
    # Deeper than the limit, shallower than the recursion limit: json.loads parses it; only the check after parsing
    # refuses it.
    depth = min(sys.getrecursionlimit() // 2, 400)
    depth -= depth % 2
    with pytest.raises(JsonLimitError, match=f"manifest.json.*deeper than {MAX_JSON_DEPTH} levels"):
        loads_limited(nested(kind, depth), "manifest.json")
    assert loads_limited(nested(kind, depth), "manifest.json", max_depth=depth) is not None  # the parser's answer


def test_nesting_past_the_recursion_limit_is_the_same_error_not_a_traceback() -> None:
    with pytest.raises(JsonLimitError, match=r"manifest\.json nests deeper than the reader's limit"):
        loads_limited("[" * 100_000 + "]" * 100_000, "manifest.json")


@pytest.mark.parametrize(("empty", "kind"), [("[]", "arrays"), ("{}", "objects")])
def test_a_bomb_of_empty_containers_is_refused_before_parsing(empty: str, kind: str) -> None:
    limit = 1000
    at_limit = "[" + ",".join([empty] * (limit - 1)) + "]"  # the outer array and limit - 1 empty ones
    assert len(loads_limited(at_limit, "index.json", max_containers=limit)) == limit - 1
    bomb = "[" + ",".join([empty] * limit) + "]"
    with pytest.raises(JsonLimitError, match=f"index.json holds up to {limit + 1} objects and arrays, more than the "
                                             f"reader's limit of {limit}"):
        loads_limited(bomb, "index.json", max_containers=limit)

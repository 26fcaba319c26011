"""What the server's routes share: request-id matching, the error body, the disconnect guard."""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus

from refractor.inference.server_state import BadRequest, ServerState, error_response, run_until_disconnect


def _state(active: set[str]) -> ServerState:
    state = ServerState(
        engine=None, tokenizer=None, model_name="m", max_model_len=64, chat_template=None, metrics=None
    )
    state.active_request_ids = set(active)
    return state


def test_matching_ids_maps_external_ids_to_each_route_engine_ids():
    state = _state({"cmpl-a-0", "cmpl-a-1", "chatcmpl-b", "generate-tokens-c", "d", "cmpl-ab-0"})
    assert sorted(state.matching_ids(["a"])) == ["cmpl-a-0", "cmpl-a-1"]  # not cmpl-ab-0
    assert state.matching_ids(["b"]) == ["chatcmpl-b"]
    assert state.matching_ids(["c"]) == ["generate-tokens-c"]
    assert state.matching_ids(["d"]) == ["d"]
    assert state.matching_ids(["chatcmpl-b"]) == ["chatcmpl-b"]  # the engine id itself
    assert state.matching_ids(["missing"]) == []


def test_bad_request_is_400_unless_told_and_the_body_has_openai_error_shape():
    assert BadRequest("x").status == HTTPStatus.BAD_REQUEST
    assert BadRequest("x", HTTPStatus.NOT_FOUND).status == HTTPStatus.NOT_FOUND
    response = error_response("no such model", HTTPStatus.NOT_FOUND)
    assert response.status_code == 404
    assert json.loads(response.body) == {
        "error": {"message": "no such model", "type": "NotFoundError", "param": None, "code": 404}
    }
    assert json.loads(error_response("boom", HTTPStatus.INTERNAL_SERVER_ERROR).body)["error"]["type"] == (
        "InternalServerError"
    )


class _Request:
    """Only ``receive``: the ASGI messages a client sends while its request runs."""

    def __init__(self, disconnect_after_s: float | None):
        self.disconnect_after_s = disconnect_after_s

    async def receive(self) -> dict:
        if self.disconnect_after_s is None:
            await asyncio.Event().wait()  # the client stays
        await asyncio.sleep(self.disconnect_after_s)
        return {"type": "http.disconnect"}


def test_run_until_disconnect_returns_the_result_while_the_client_stays():
    async def work() -> str:
        await asyncio.sleep(0.01)
        return "done"

    assert asyncio.run(run_until_disconnect(_Request(None), work())) == "done"


def test_run_until_disconnect_cancels_the_work_when_the_client_leaves():
    cancelled = []

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "never"

    assert asyncio.run(run_until_disconnect(_Request(0.01), work())) is None
    assert cancelled == [True]

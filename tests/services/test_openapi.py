"""`/openapi.json` declares what the gateway reads and answers (issue 22), and every error the
app itself produces (unknown route, bad query parameter) is OpenAI's error object.

The gateway app is served in-process without its lifespan (no broker needed): these routes
read only the batch database, which it opens in the test's data dir."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


@pytest.fixture
def client(tmp_path):
    return TestClient(create_app(GatewaySettings(data_dir=str(tmp_path))))


def _resolve(doc: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_every_operation_declares_its_body_and_success_answer(client):
    doc = client.get("/openapi.json").json()
    ops = [(path, method, op) for path, methods in doc["paths"].items() for method, op in methods.items()]
    assert len(ops) >= 19
    ids = [op["operationId"] for _, _, op in ops]
    assert len(ids) == len(set(ids))
    for path, method, op in ops:
        where = f"{method.upper()} {path}"
        if method == "post" and path != "/v1/batches/{batch_id}/cancel":  # cancel takes no body
            content = op["requestBody"]["content"]
            (media, declared), *_ = content.items()
            schema = _resolve(doc, declared["schema"])
            assert schema.get("properties"), f"{where}: body schema has no properties"
        ok = [status for status in op["responses"] if status.startswith("2")]
        assert len(ok) == 1, where
        content = op["responses"][ok[0]]["content"]
        assert content and all("schema" in c for c in content.values()), where
        error = _resolve(doc, op["responses"]["default"]["content"]["application/json"]["schema"])
        assert error["properties"].keys() == {"error"}, where
        assert "422" not in op["responses"], where  # we answer 400 in OpenAI's shape instead
        if path.startswith("/v1/"):
            assert op["security"] == [{"bearer": []}], where
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = _resolve(doc, chat["requestBody"]["content"]["application/json"]["schema"])
    assert {"model", "messages"} <= set(body["required"])
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    upload = doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert _resolve(doc, upload)["properties"]["file"]["format"] == "binary"


def test_links_chain_upload_batch_retrieve_cancel_and_content(client):
    doc = client.get("/openapi.json").json()
    by_id = {op["operationId"]: op for methods in doc["paths"].values() for op in methods.values()}

    def links(op_id: str) -> dict:
        (ok,) = [r for s, r in by_id[op_id]["responses"].items() if s.startswith("2")]
        return ok["links"]

    def targets(op_id: str) -> set[str]:
        return {link["operationId"] for link in links(op_id).values()}

    assert links("uploadFile")["CreateBatch"]["requestBody"]["input_file_id"] == "$response.body#/id"
    assert {"createBatch", "retrieveFile", "downloadFile", "deleteFile"} <= targets("uploadFile")
    assert {"retrieveBatch", "cancelBatch"} <= targets("createBatch")
    assert {"downloadFile", "cancelBatch"} <= targets("retrieveBatch")
    assert links("retrieveBatch")["DownloadOutput"]["parameters"] == {"file_id": "$response.body#/output_file_id"}
    assert "retrieveBatch" in targets("cancelBatch")
    assert "revokeKey" in targets("createKey")
    for op_id in by_id:  # every link names an operation that exists
        for response in by_id[op_id]["responses"].values():
            for link in response.get("links", {}).values():
                assert link["operationId"] in by_id, (op_id, link)


def test_framework_errors_are_openai_errors(client):
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.put("/v1/models")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = client.get("/v1/files", params={"limit": "many"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "limit" and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/batches", json={"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"

"""schemathesis against the rollout server's own /openapi.json: a few hundred seeded requests to every operation,
half of them valid per the schema and half hostile (wrong types, out of range, missing fields). None may get a 5xx
(nor a 200 stream that carries a server error), every error is OpenAI's shape, and the server still answers a
valid request afterwards."""
from rl_helpers import call, fuzz_openapi

EXAMPLES_PER_MODE = 150
AUTH = {"Authorization": "Bearer s3cret"}  # so weight loads reach validation and the store, not only 401


def test_fuzzed_requests_never_get_a_5xx_and_the_server_keeps_serving(rollout):
    url = rollout["url"]

    def check(mode, case, response):
        where = f"{case.method} {case.path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:500]}"
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, where
        elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            assert '"server_error"' not in response.text, where

    statuses = fuzz_openapi(url, EXAMPLES_PER_MODE, check, headers=AUTH)
    # both kinds reached the generation endpoints, and some fuzzed completions were served
    assert any(m == "negative" and p == "/v1/completions" and s == 400 for m, p, s in statuses)
    assert any(p == "/v1/completions" and s == 200 for _, p, s in statuses)
    status, body = call("POST", f"{url}/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "seed": 1})
    assert status == 200 and body["choices"][0]["token_ids"]

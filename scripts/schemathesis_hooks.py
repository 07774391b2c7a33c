"""The rules of the lockbroker API that OpenAPI 3.1 cannot state, for schemathesis.

`/openapi.json` states every rule it can (types, bounds, patterns, required parameters). Some
rules tie parameters together, and OpenAPI has no way to say that:

1. A parameter may come in the query string or in the JSON body; in both, only with the same
   value (api.md: otherwise `400`).
2. Release and renew need the lease token, in the `Lock-Token` header or the `token` query
   parameter (both: the same value).
3. A release sends either the token or `force=true`, never both (a force release takes no
   token; one given with it is refused as a mistake).
4. A semaphore acquire needs `limit`, in the query string or the body.
5. An inspect takes `wait_ms` only with `watch` (it is how long the watch waits).
6. An acquire under a session (`session`) takes no `ttl_ms`: the lease lives as long as the
   session.
7. A several-keys request names each key once (`keys`).

Each request generated to be valid is made to keep these rules, and nothing else is changed, so that
schemathesis checks everything the document says and nothing it cannot say.
"""

import schemathesis

# A well-formed token that no acquire hands out: release and renew answer 404 not_held.
NO_SUCH_TOKEN = "schemathesis-no-such-token"

TOKEN_OPERATIONS = {
    ("DELETE", "/locks"),
    ("DELETE", "/locks/{key}"),
    ("DELETE", "/semaphores/{key}"),
    ("POST", "/locks/{key}/renew"),
    ("POST", "/semaphores/{key}/renew"),
}

ACQUIRE_OPERATIONS = {
    ("POST", "/locks"),
    ("POST", "/locks/{key}"),
    ("POST", "/semaphores/{key}"),
}

WATCH_OPERATIONS = {
    ("GET", "/locks/{key}"),
    ("GET", "/semaphores/{key}"),
}


@schemathesis.hook
def map_case(context, case):
    # Only requests meant to be valid: a request meant to break the document is refused
    # whatever these rules say, and changing it could take out what breaks it.
    if case.meta is not None and case.meta.generation.mode != "positive":
        return case
    query = case.query if isinstance(case.query, dict) else None
    # Rule 1: a name in both the query string and the body is kept in the query string only.
    if query and isinstance(case.body, dict):
        case.body = {name: value for name, value in case.body.items() if name not in query}
    if (case.method.upper(), case.path) == ("POST", "/semaphores/{key}"):
        body = case.body if isinstance(case.body, dict) else {}
        if "limit" not in body and "limit" not in (query or {}):
            # Rule 4: one of them is required.
            query = query if query is not None else {}
            query["limit"] = 1
            case.query = query
    if (case.method.upper(), case.path) in ACQUIRE_OPERATIONS:
        body = case.body if isinstance(case.body, dict) else {}
        if "session" in (query or {}) or "session" in body:
            # Rule 6: a session's lease has no ttl_ms.
            if query:
                query.pop("ttl_ms", None)
            body.pop("ttl_ms", None)
    if (case.method.upper(), case.path) == ("DELETE", "/locks") and query and "keys" in query:
        # Rule 7: each key once.
        seen = []
        for key in str(query["keys"]).split(","):
            key = key.strip()
            if key and key not in seen:
                seen.append(key)
        query["keys"] = ",".join(seen) or "k"
    if (case.method.upper(), case.path) == ("POST", "/locks") and isinstance(case.body, dict):
        keys = case.body.get("keys")
        if isinstance(keys, list):
            # Rule 7: each key once.
            case.body["keys"] = list(dict.fromkeys(keys)) or ["k"]
    if (case.method.upper(), case.path) in WATCH_OPERATIONS:
        body = case.body if isinstance(case.body, dict) else {}
        if "watch" not in (query or {}) and "watch" not in body:
            # Rule 5: without watch, no wait_ms.
            if query:
                query.pop("wait_ms", None)
            if isinstance(case.body, dict):
                case.body.pop("wait_ms", None)
    if (case.method.upper(), case.path) in TOKEN_OPERATIONS:
        headers = case.headers if isinstance(case.headers, dict) else {}
        query = query if query is not None else {}
        header_name = next((h for h in headers if h.lower() == "lock-token"), None)
        if "force" in query:
            # Rule 3: force=true goes alone.
            query.pop("token", None)
            if header_name is not None:
                headers.pop(header_name)
        elif header_name is not None and "token" in query:
            # Rule 2: one place is enough (two would have to agree).
            query.pop("token")
        elif header_name is None and "token" not in query:
            # Rule 2: one of them is required.
            headers["Lock-Token"] = NO_SUCH_TOKEN
        case.headers = headers
        case.query = query
    return case

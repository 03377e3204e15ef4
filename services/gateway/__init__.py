"""The gateway: OpenAI-compatible HTTP (FastAPI + uvicorn) and the public gRPC API, over the admission queue.

    edge        app.py (routes) + responses.py (SSE / JSON)   grpc_api.py (Generation servicer)
                        \\                                     /
    parsing      protocol.py (OpenAI bodies -> GenerationRequest), prompts.py (chat template, tokens)
                        \\                                     /
    core         core.py: authenticate, admit (readiness, backpressure, rate limit, idempotency,
                 coalescing, enqueue), follow the result stream, detach (cancel when the client is gone)
                        |
    pieces       api_keys.py  rate_limit.py  backpressure.py  readiness.py  cached_read.py
                 idempotency.py  coalescing.py  request_record.py  openai_format.py  sse.py  body_limit.py
                 http_errors.py  metrics.py  served_model.py  config.py  server.py (``pdserve gateway``)

A request's life: the edge parses and validates it (400 before anything is
queued), the core checks that a decode worker is ready (503), that the queue has
room (429), and the tenant's budget (429 + x-ratelimit-*), writes the request's
record, claims its Idempotency-Key, and enqueues it, unless an identical greedy
or seeded request is in flight: then it follows that one's result stream
(coalescing.py). The edge then forwards the
request's result stream; every SSE event carries the stream entry id, so a
client that lost the connection resumes with ``Last-Event-ID`` (on
``GET /v1/requests/{id}/events`` or by retrying the POST with its
Idempotency-Key). A client that leaves and does not come back within
``disconnect_grace_s`` cancels the request.

Redis keys the gateway adds (beside the queue's, see services.queue)::

    pd:gw:req:<request_id>     hash: kind (chat|completion), model, created, include_usage,
                               logprobs, tenant, deadline, prompt_tokens, source (a coalesced
                               follower: its leader), coalesce (its key), readers (clients
                               attached right now, all replicas; a leader's count its
                               followers' too), cancelled; TTL record_ttl_s.
                               What a resumed stream needs to look like the original.
    pd:gw:idem:<tenant>:<h>    string: request id for Idempotency-Key (h = sha256 of the key),
                               SET NX, TTL idempotency_ttl_s
    pd:{q}:co:<h>              string: "<leader request id>|<deadline>" for identical requests in
                               flight (h = sha256 of tenant, tier, model, token ids, sampling),
                               set if absent by the enqueue script (in the queue's slot),
                               deleted at the leader's end; TTL its deadline
    pd:gw:rl:<tenant>          hash: req, tok (token-bucket levels), ts (ms, Redis TIME);
                               the tenant's per-minute request and token budgets, shared by
                               every gateway replica (rate_limit.py); TTL 2 minutes
"""

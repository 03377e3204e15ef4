"""The durable admission queue on Redis Streams: priorities, retries, dead letters, result streams.

Redis layout (``{q}`` is a Cluster hash tag: every queue key shares one slot,
so the Lua scripts in scripts.py touch them atomically)::

    pd:{q}:req:<tier>          stream per priority tier (interactive, standard, batch by
                               default), one entry per queued request (message.py);
                               consumer group "routers". An entry is deleted (XACK +
                               XDEL) when its request reaches a final state and never
                               trimmed, so XLEN = requests waiting or in flight.
    pd:{q}:dead                dead-letter stream: original fields + last_error,
                               error_code, worker, delivery_count, tier, entry_id, dead_at
    pd:{q}:admission           hash tokens:<tier> -> prompt tokens of queued requests
    pd:{q}:state:<request_id>  hash: first (entry id enqueue returned), entry (live entry),
                               tier, tokens, status queued|done|dead|expired, and after a
                               retry attempts, last_error, worker. No TTL while queued;
                               state_ttl_s once final (the idempotency window).
    pd:{q}:co:<h>              the gateway's coalescing key (services/gateway/coalescing.py),
                               in this slot so the enqueue script can claim it as it queues
    pd:res:{gw-<hex>}:<request_id>   result stream of a request a gateway queued (its id is
                               gw-<hex>.<hex>, the gateway's tag first): type chunk|final|error
                               + JSON data, TTL result_ttl_s refreshed by every write (results.py);
                               pd:res:{<request_id>} for an id without a gateway tag
    pd:res:{gw-<hex>}:inbox    the gateway's delivery stream: a copy of each event of its
                               requests (rid, id, type, data), read and trimmed by that gateway

A request's life here: ``AdmissionQueue.enqueue`` (gateway) -> ``QueueConsumer.next``
or ``reclaim`` (router) -> decode workers write ``ResultWriter`` events -> the router
``ack``s at the final event, or ``fail``s (retry, or dead letter + error event) ->
the gateway reads its delivery stream (services/gateway/delivery.py) and streams
each request's events to its client.
"""

from services.queue.admission import AdmissionQueue, Admitted, QueueDepth, TierDepth
from services.queue.config import QueueConfig
from services.queue.consumer import Delivery, QueueConsumer
from services.queue.dead_letters import DeadLetter, DeadLetters
from services.errors import NotFoundError, ServiceUnavailableError
from services.queue.message import QueuedRequest
from services.queue.results import ResultReader, ResultWriter

__all__ = ["AdmissionQueue", "Admitted", "DeadLetter", "DeadLetters", "Delivery", "NotFoundError", "QueueConfig",
           "QueueConsumer", "QueueDepth", "ServiceUnavailableError", "QueuedRequest", "ResultReader", "ResultWriter",
           "TierDepth"]

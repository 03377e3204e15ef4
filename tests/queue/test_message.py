"""The queue message and config: what is written reads back, and what is malformed is named."""

import pytest

from services.errors import InvalidRequestError
from services.queue import QueueConfig, QueuedRequest


def _request(**kw):
    base = {"request_id": "chatcmpl-1", "tenant": "acme", "tier": "batch", "model": "m", "token_ids": [1, 2, 3],
            "sampling": {"temperature": 0.7, "stop": ["\n"], "seed": 5}, "deadline": 1700000000.5,
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "enqueued_at": 1699999999.25}
    base.update(kw)
    return QueuedRequest(**base)


def test_fields_round_trip_with_str_and_bytes_keys():
    req = _request()
    fields = req.to_fields()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    assert QueuedRequest.from_fields(fields) == req
    as_bytes = {k.encode(): v.encode() for k, v in fields.items()}
    assert QueuedRequest.from_fields(as_bytes) == req
    assert req.prompt_tokens == 3


@pytest.mark.parametrize("mutate, names", [
    (lambda f: f.pop("token_ids"), "missing fields ['token_ids']"),
    (lambda f: f.update(token_ids="[1, 2"), "invalid JSON"),
    (lambda f: f.update(token_ids="[1, -2]"), "token_ids"),
    (lambda f: f.update(token_ids="[]"), "token_ids"),
    (lambda f: f.update(token_ids="[1.5]"), "token_ids"),
    (lambda f: f.update(sampling="[1]"), "sampling"),
    (lambda f: f.update(deadline="soon"), "non-numeric deadline"),
    (lambda f: f.update(v="2"), "schema version '2'"),
    (lambda f: f.update(request_id="a b{c}"), "request_id"),
    (lambda f: f.update(choices="two"), "non-numeric deadline, enqueued_at or choices"),
    (lambda f: f.update(choices="0"), "choices must be an integer"),
    (lambda f: f.update(choices="129"), "choices must be an integer"),
])
def test_malformed_entries_are_detected_with_a_reason(mutate, names):
    fields = _request().to_fields()
    mutate(fields)
    with pytest.raises(InvalidRequestError) as info:
        QueuedRequest.from_fields(fields)
    assert names in str(info.value)


def test_expired_only_with_a_deadline():
    assert not _request(deadline=0).expired(now=1e12)
    assert _request(deadline=100.0).expired(now=100.0)
    assert not _request(deadline=100.0).expired(now=99.9)


@pytest.mark.parametrize("kw, names", [
    ({"tiers": ()}, "at least one"),
    ({"tiers": ("a", "a"), "weights": {"a": 1}}, "distinct"),
    ({"tiers": ("gold",)}, "weights must be given"),
    ({"tiers": ("gold", "lead"), "weights": {"gold": 2}}, "exactly the tiers"),
    ({"weights": {"interactive": 0, "standard": 1, "batch": 1}}, "weight of tier 'interactive'"),
    ({"max_deliveries": 0}, "max_deliveries"),
    ({"tiers": ("Bad Name",), "weights": {"Bad Name": 1}}, "tier names"),
    ({"retry_after_s": 0}, "retry_after_s"),
])
def test_config_rejects_bad_values(kw, names):
    with pytest.raises(ValueError, match=names):
        QueueConfig(**kw)


def test_config_defaults():
    cfg = QueueConfig()
    assert cfg.tiers == ("interactive", "standard", "batch")
    assert cfg.weights == {"interactive": 8, "standard": 3, "batch": 1}
    assert QueueConfig(tiers=("gold", "lead"), weights={"gold": 5, "lead": 1}).weights["gold"] == 5


def test_an_entry_of_n_choices_names_each_choice_and_its_seed():
    from services.queue.message import choice_sampling

    req = _request(choices=3)
    assert QueuedRequest.from_fields(req.to_fields()) == req
    assert "choices" not in _request().to_fields()  # one choice: the entry is written as before
    assert req.choice_ids == ["chatcmpl-1", "chatcmpl-1-1", "chatcmpl-1-2"]
    assert [choice_sampling(req.sampling, i)["seed"] for i in range(3)] == [5, 6, 7]
    assert choice_sampling({"seed": 2**63 - 1}, 1)["seed"] == -2**63  # wraps within int64
    assert "seed" not in choice_sampling({"temperature": 1.0}, 2)

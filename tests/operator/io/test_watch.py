"""The watch cache's view of a model's pods against the operator's own writes (issue 37: the pod step acts on
it with no list of its own): a write counts as unseen until the watch shows it, whichever came first, and is
overdue after watch.EXPECT_SECONDS; a list from the API server repairs what the watch missed."""

from __future__ import annotations

import pytest
from spyre_operator.io import watch
from spyre_operator.io.watch import WatchCache

KEY = ("ml", "granite")


def pod(name: str, version: str = "10", deleting: bool = False) -> dict:
    meta = {"name": name, "resourceVersion": version}
    return {"metadata": {**meta, "deletionTimestamp": "2026-11-26T00:00:00Z"} if deleting else meta}


def test_a_created_pod_is_unseen_until_the_watch_shows_it():
    cache = WatchCache()
    assert cache.unseen_writes(KEY) is None
    cache.expect(KEY, created=["a"], deleted=[])
    assert 0 < cache.unseen_writes(KEY) <= watch.EXPECT_SECONDS
    cache.put_pod(("ml", "other"), pod("a"))  # another model's pod of that name is not ours
    assert cache.unseen_writes(KEY)
    cache.put_pod(KEY, pod("a"))
    assert cache.unseen_writes(KEY) is None


def test_a_write_the_watch_showed_before_the_api_servers_answer_is_not_expected():
    cache = WatchCache()
    cache.put_pod(KEY, pod("a"))
    cache.put_pod(KEY, pod("b", deleting=True))
    cache.expect(KEY, created=["a"], deleted=["b", "c"])  # c: gone from the cache already
    assert cache.unseen_writes(KEY) is None


def test_a_deleted_pod_is_seen_terminating_or_gone():
    cache = WatchCache()
    for name in ("a", "b"):
        cache.put_pod(KEY, pod(name))
    cache.expect(KEY, created=[], deleted=["a", "b"])
    cache.put_pod(KEY, pod("a", version="11"))  # a change, not the deletion
    assert cache.unseen_writes(KEY)
    cache.put_pod(KEY, pod("a", version="12", deleting=True))
    assert cache.unseen_writes(KEY)
    cache.drop_pod(KEY, "b")
    assert cache.unseen_writes(KEY) is None


def test_a_pod_that_came_and_went_unseen_is_settled_by_its_deletion():
    cache = WatchCache()
    cache.expect(KEY, created=["a"], deleted=[])
    cache.drop_pod(KEY, "a")  # kopf batched ADDED and DELETED: only the deletion reached the handlers
    assert cache.unseen_writes(KEY) is None


def test_an_unseen_write_is_overdue_after_expect_seconds(monkeypatch):
    cache = WatchCache()
    monkeypatch.setattr(watch, "EXPECT_SECONDS", 0.0)
    cache.expect(KEY, created=["a"], deleted=[])
    assert cache.unseen_writes(KEY) == 0.0  # overdue: the cache cannot answer, the pods are listed


def test_a_list_repairs_what_the_watch_missed_and_expects_the_rest():
    cache = WatchCache()
    cache.put_pod(KEY, pod("ghost", version="5"))  # deleted while a watch restarted: no DELETED event
    cache.put_pod(KEY, pod("newer", version="30"))  # created after the list was served
    cache.put_pod(KEY, pod("kept", version="8"))
    cache.expect(KEY, created=["late"], deleted=[])
    cache.relisted(KEY, [pod("kept", version="8"), pod("late", version="19")], version="20")
    assert sorted(p["metadata"]["name"] for p in cache.pods(KEY)) == ["kept", "newer"]
    assert cache.unseen_writes(KEY)  # "late" is still to come through the watch, "newer" to go from it
    cache.put_pod(KEY, pod("late", version="19"))
    assert cache.unseen_writes(KEY)
    cache.drop_pod(KEY, "newer")
    assert cache.unseen_writes(KEY) is None


@pytest.mark.parametrize("version", ["", "not-a-number"])
def test_without_comparable_versions_nothing_is_dropped(version):
    cache = WatchCache()
    cache.put_pod(KEY, pod("a", version="5"))
    cache.relisted(KEY, [], version=version)
    assert [p["metadata"]["name"] for p in cache.pods(KEY)] == ["a"] and cache.unseen_writes(KEY)


def test_a_deleted_model_expects_nothing():
    cache = WatchCache()
    cache.expect(KEY, created=["a"], deleted=[])
    cache.drop_model(KEY)
    assert cache.unseen_writes(KEY) is None

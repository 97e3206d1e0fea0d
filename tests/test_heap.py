"""service.heap: objects alive at start-up leave the garbage collector's generations."""
from __future__ import annotations

import gc

from service.heap import freeze_heap


def test_freeze_heap_exempts_live_objects():
    gc.unfreeze()
    keep = [object() for _ in range(100)]
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()
        gc.callbacks[:] = [cb for cb in gc.callbacks if type(cb).__name__ != "_PauseLog"]
    assert gc.get_freeze_count() == 0


def test_a_long_collection_is_logged(caplog):
    import gc

    from service import heap

    hook = heap._PauseLog(0.0)  # every collection counts as long
    gc.callbacks.append(hook)
    try:
        with caplog.at_level("WARNING", logger="rnnserve.heap"):
            gc.collect()
    finally:
        gc.callbacks.remove(hook)
    assert any("paused this process" in r.getMessage() for r in caplog.records)



def test_shorter_collections_are_logged_at_debug_level_only(caplog, monkeypatch):
    from service import heap

    hook = heap._PauseLog(60.0)  # no collection is a warning
    monkeypatch.setattr(heap, "NOTE_GC_S", 0.0)  # every collection is worth a debug note
    for level, expected in (("INFO", []), ("DEBUG", ["DEBUG"])):
        caplog.clear()
        with caplog.at_level(level, logger="rnnserve.heap"):
            hook("start", {})
            hook("stop", {"generation": 2, "collected": 0})
        assert [r.levelname for r in caplog.records if "paused this process" in r.getMessage()] == expected

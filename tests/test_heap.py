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
    assert gc.get_freeze_count() == 0

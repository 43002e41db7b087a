"""Which checkpoint a job resumes from when its recorded one cannot be read (workers/runtime/stages.py)."""

from __future__ import annotations

import pytest
import torch

from genserver.storage import LocalStorage
from workers.runtime import blob, stages

JOB = "6f1c2a9e-0000-4000-8000-000000000001"


def _store(tmp_path, steps: dict[int, bytes | None]) -> LocalStorage:
    """A job's checkpoints at these steps: a whole blob (None) or the bytes given (what a lost write left)."""
    store = LocalStorage(tmp_path)
    for step, lost in steps.items():
        data = lost if lost is not None else blob.dumps({"latents": torch.full((2,), float(step)), "step": step})
        store.put(stages.checkpoint_key(JOB, step), data)
    store.put(f"checkpoints/{JOB}/.tmp-abc", b"a write that never got its name")
    store.put(f"checkpoints/{JOB}-other/step-00009.pt", blob.dumps({"step": 9}))  # another job's folder
    return store


def test_the_latest_readable_checkpoint_before_the_lost_one_within_the_segment(tmp_path):
    store = _store(tmp_path, {4: None, 8: None, 12: b"", 16: b""})
    assert stages.previous_checkpoint(store, JOB, before=16, not_before=0) == (8, stages.checkpoint_key(JOB, 8))
    assert stages.previous_checkpoint(store, JOB, before=8, not_before=0) == (4, stages.checkpoint_key(JOB, 4))
    assert stages.previous_checkpoint(store, JOB, before=16, not_before=10) is None  # the segment began at 10
    assert stages.previous_checkpoint(store, JOB, before=4, not_before=0) is None


def test_reading_a_lost_checkpoint_says_which_and_why(tmp_path):
    store = _store(tmp_path, {12: bytes(64)})
    with pytest.raises(stages.CheckpointUnreadable, match="step-00012.pt.*not a blob"):
        stages.read_checkpoint(store, stages.checkpoint_key(JOB, 12))
    with pytest.raises(stages.CheckpointUnreadable, match="does not exist"):
        stages.read_checkpoint(store, stages.checkpoint_key(JOB, 13))

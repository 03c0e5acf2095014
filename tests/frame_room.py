"""A check the engine tests share: is this thread's loop running from notebook 03's frame room?"""

from __future__ import annotations

import sys

from minivllm.engine import FRAME_ROOM_SLOTS


def under_frame_room() -> bool:
    """Whether a frame of ``call_with_frame_room`` is on the caller's stack (its one frame
    with ``FRAME_ROOM_SLOTS`` locals or more)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_nlocals >= FRAME_ROOM_SLOTS:
            return True
        frame = frame.f_back
    return False

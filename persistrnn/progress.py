"""Progress bars for long runs (rich), off when not asked for."""

from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def track(items: Iterable[T], enabled: bool, label: str, total: int | None = None) -> Iterable[T]:
    """``items``, with a transient progress bar labelled ``label`` when
    ``enabled`` (``total``: their count, where ``items`` has no length)."""
    if not enabled:
        return items
    from rich.progress import track as rich_track

    return rich_track(items, description=label, transient=True, total=total)

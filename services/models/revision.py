"""Hub revisions of the models: which commit of a repo id is loaded. A local folder has none."""

from __future__ import annotations

from pathlib import Path


def folder_revision_error(what: str, name_or_path: str | Path, revision: str | None) -> str | None:
    """Why `revision` cannot be honoured for `name_or_path`, or None when it can (no revision, or
    a hub repo id). A folder holds whatever was copied into it: transformers would ignore the
    revision and load it anyway, while the config claims a pinned commit, so it is refused."""
    if revision is None or not Path(name_or_path).expanduser().exists():
        return None
    return (f"{what} revision {revision!r} was given, but the {what} {str(name_or_path)!r} is a local folder, "
            f"which has no revisions: remove the {what} revision, or name the hub repo id to load that commit")

"""Keep the last K checkpoints of a save directory, never the newest complete one, and clear what killed saves left.

A long run that saves every few minutes fills its disk unless old tags go; deleting them is only safe for tags that
are complete (published with a manifest, manifest.py) and older than the one `latest` names: that one is what a
restarted job loads. Staging and retired directories left by saves that were killed (`.<tag>.deepspeed_bnb-partial`,
`-retired`) are removed too once a newer tag is published. Run by one process (rank 0) after a successful save.
"""

import os
import re
import shutil
from typing import List, Optional

from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME, latest_tag
from deepspeed_bnb.checkpoint.format.publish import RETIRED_SUFFIX, STAGING_SUFFIX

_STEP = re.compile(r"(\d+)$")


def _order(tag: str, save_dir: str):
    """Tags sort by their trailing number (global_step<N>), then by publication time."""
    match = _STEP.search(tag)
    return (int(match.group(1)) if match else -1, os.path.getmtime(os.path.join(save_dir, tag)))


def complete_tags(save_dir: str) -> List[str]:
    """Published tags (a directory holding a manifest), oldest first."""
    tags = [name for name in os.listdir(save_dir) if not name.startswith(".")
            and os.path.isfile(os.path.join(save_dir, name, MANIFEST_NAME))]
    return sorted(tags, key=lambda tag: _order(tag, save_dir))


def prune(save_dir: str, keep: int, latest: Optional[str] = None) -> List[str]:
    """Delete all but the newest `keep` complete tags (never the one `latest` names) and leftovers of killed saves of
    older tags; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest complete checkpoint is never deleted), got {keep}")
    latest = latest or latest_tag(save_dir)
    tags = complete_tags(save_dir)
    doomed = [tag for tag in tags[:-keep] if tag != latest]
    newest = _order(latest, save_dir) if latest and os.path.isdir(os.path.join(save_dir, latest)) else None
    for name in os.listdir(save_dir):
        for suffix in (STAGING_SUFFIX, RETIRED_SUFFIX):
            if name.startswith(".") and name.endswith(suffix):
                tag = name[1:-len(suffix)]
                match = _STEP.search(tag)
                if newest is not None and match and int(match.group(1)) < newest[0]:
                    doomed.append(name)
    for name in doomed:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    return doomed

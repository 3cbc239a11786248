"""What a patch of a model's residual blocks did (the timm and torchvision patches)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List


@dataclass
class BlockPatchReport:
    """``converted``: block name -> the library's class of each converted block; ``already``:
    blocks converted by an earlier call; ``skipped``: name -> why it keeps the library's
    computation (only with ``strict=False``); ``notes``: converted blocks with a caveat."""

    library: ClassVar[str] = ""

    converted: Dict[str, str] = field(default_factory=dict)
    already: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)
    notes: Dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.converted)

    def __str__(self) -> str:
        counts: Dict[str, int] = {}
        for cls in self.converted.values():
            counts[cls] = counts.get(cls, 0) + 1
        lines = [f"maskedbranch: converted {len(self.converted)} {self.library} block(s)"]
        lines += [f"  {n} x {cls}" for cls, n in counts.items()]
        if self.already:
            lines.append(f"  {len(self.already)} block(s) were converted already")
        lines += [f"  note {name}: {why}" for name, why in self.notes.items()]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def display(name: str) -> str:
    """A module's name in a report (the root's is empty)."""
    return name or "<root>"

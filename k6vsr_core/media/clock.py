"""An output's frame times kept as its variable-rate source has them (`--fps source`): each frame's start in the
source's own ticks, and the last one's end, so every frame plays when it did and the clip lasts as long."""

from __future__ import annotations

from fractions import Fraction

from pydantic import BaseModel, ConfigDict, model_validator

# Matroska's clock (its default timestamp scale): the coarsest any output container keeps a frame's time to.
MATROSKA_TICK = Fraction(1, 1000)


class Timeline(BaseModel):
    """Frame times from 0: `stamps[i]` is frame i's start and `stamps[-1]` the last frame's end, in `time_base`."""

    model_config = ConfigDict(frozen=True)

    time_base: str  # a fraction of a second, e.g. "1/90000"
    stamps: tuple[int, ...]

    @model_validator(mode="after")
    def _ascending(self) -> Timeline:
        if len(self.stamps) < 2 or self.stamps[0] != 0:
            raise ValueError("a timeline holds at least one frame and starts at 0")
        if any(later <= earlier for earlier, later in zip(self.stamps, self.stamps[1:], strict=False)):
            raise ValueError("a timeline's frame times must rise")
        return self

    @property
    def tick(self) -> Fraction:
        return Fraction(self.time_base)

    @property
    def frames(self) -> int:
        return len(self.stamps) - 1

    @property
    def duration_s(self) -> Fraction:
        return self.stamps[-1] * self.tick

    @property
    def mean_rate(self) -> Fraction:
        return self.frames / self.duration_s

    def start_s(self, frame: int) -> Fraction:
        """When frame `frame` starts (`frames`: the clip's end)."""
        return self.stamps[frame] * self.tick

    def part(self, start: int, stop: int) -> Timeline:
        """Frames `start` to `stop` (exclusive) as a timeline of their own, from 0."""
        if not 0 <= start < stop <= self.frames:
            raise ValueError(f"frames {start} to {stop} are not in a timeline of {self.frames}")
        first = self.stamps[start]
        return Timeline(time_base=self.time_base, stamps=tuple(s - first for s in self.stamps[start : stop + 1]))

    def shortest_s(self) -> Fraction:
        return min(b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)) * self.tick


FrameRate = int | Fraction | Timeline  # a constant rate, exact, or the frame times themselves


def span_s(num_frames: int, rate: FrameRate) -> Fraction:
    """How long the first `num_frames` frames play at `rate`."""
    if isinstance(rate, Timeline):
        return rate.start_s(num_frames)
    return num_frames / Fraction(rate)

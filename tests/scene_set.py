"""A labelled set of synthetic clips for the scene-cut detector: where every hard cut is, and what must not be one.

Each clip is a run of shots drawn from a smooth random texture seen through a moving window, with a tint (the
colour), a level and contrast (the luma) and a texture of its own. A hard cut changes one of these between two
frames, or all of them: `colour` the tint only (the luma and the pattern carry on), `luma` the level only, `texture`
the pattern only (the same tint and level), `motion` where the camera looks and how it moves only (the same pattern
field, tint and level), `all` everything. Every hard-cut clip holds shots of 1, 8 and 60 frames between longer ones,
so its cuts are 1, 8 and 60 frames apart. The clips with no cut hold what a detector must not call one: fades through
black and dissolves (a gradual change over many frames), flashes (one to three frames brightened, then the same
shot again) and fast pans (a fifth of the frame a frame). Each clip is written at 96x64 and 192x128, H.264 at CRF 28
(through PyAV, as a run's sources are), so the detector sees compression noise.

`python bench/scene_accuracy.py` prints recall and precision on the set; tests/contract/test_scenes.py asserts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import cv2
import numpy as np

from k6vsr_core import media
from k6vsr_core.media.encoding import VideoEncoding

SIZES = ((64, 96), (128, 192))  # (H, W)
ENCODING = VideoEncoding(codec="h264", crf=28)
FPS = 24
# A hard cut counts as found when the detector names a frame at most this far from it.
TOLERANCE = 1


@dataclass(frozen=True)
class Look:
    """What one shot shows: a texture field, where the camera starts in it and how it moves, its tint and luma."""

    texture: str = "blobs"  # blobs | fine | stripes
    seed: int = 0
    origin: tuple[float, float] = (0.0, 0.0)  # (y, x) in frame heights / widths
    motion: tuple[float, float] = (0.004, 0.012)  # (y, x) per frame, in frame heights / widths
    tint: tuple[float, float] = (0.0, 0.0)  # (U, V) chroma, each about -0.3 to 0.3
    level: float = 0.5  # mean luma
    contrast: float = 0.18  # luma standard deviation


@dataclass(frozen=True)
class Shot:
    look: Look
    frames: int
    # Frames since the look's camera started: a shot that carries on after a cut in colour or luma only moves on.
    offset: int = 0


@dataclass(frozen=True)
class Clip:
    name: str
    category: str
    shots: tuple[Shot, ...]
    # Effects laid over the frames: ("flash", first, count, gain), ("fade", first, count) through black to the next
    # shot, ("dissolve", first, count) from one shot into the next.
    effects: tuple[tuple, ...] = ()
    cuts: tuple[int, ...] = field(default=())

    @property
    def num_frames(self) -> int:
        return sum(shot.frames for shot in self.shots)


def _periodic(seed: int, cycles: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    """Smooth noise that wraps at its edges, drawn from `seed` at frequencies up to `cycles` per field: the same
    picture (up to scale) at any `shape`."""
    rng = np.random.default_rng(seed)
    ky, kx = cycles
    fy, fx = np.mgrid[-ky : ky + 1, -kx : kx + 1]
    envelope = np.exp(-((fy / ky) ** 2 + (fx / kx) ** 2))
    spectrum = np.zeros(shape, np.complex128)
    spectrum[fy % shape[0], fx % shape[1]] = envelope * (
        rng.standard_normal(fy.shape) + 1j * rng.standard_normal(fy.shape)
    )
    return np.real(np.fft.ifft2(spectrum))


def _field(texture: str, seed: int, size: tuple[int, int]) -> np.ndarray:
    """A texture three frames wide and tall that wraps at its edges, zero mean and unit deviation."""
    shape = (3 * size[0], 3 * size[1])
    if texture == "stripes":
        y, x = np.mgrid[0 : shape[0], 0 : shape[1]]
        warp = _periodic(seed, (6, 9), shape)
        field = np.sin(2 * np.pi * (7 * x / shape[1] + 2 * y / shape[0]) + 2.0 * warp / warp.std())
    else:
        field = _periodic(seed, {"blobs": (6, 9), "fine": (24, 36)}[texture], shape)
    return ((field - field.mean()) / (field.std() + 1e-9)).astype(np.float32)


def _render(look: Look, count: int, offset: int, size: tuple[int, int]) -> np.ndarray:
    """`count` RGB frames of `look`, from `offset` frames after its camera started."""
    height, width = size
    texture = _field(look.texture, look.seed, size)
    frames = np.empty((count, height, width, 3), np.uint8)
    for i in range(count):
        t = offset + i
        y = (look.origin[0] + 1.0 + look.motion[0] * t) * height
        x = (look.origin[1] + 1.0 + look.motion[1] * t) * width
        matrix = np.float32([[1, 0, x], [0, 1, y]])
        view = cv2.warpAffine(
            texture, matrix, (width, height), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, borderMode=cv2.BORDER_WRAP
        )
        luma = look.level + look.contrast * view
        u, v = look.tint
        rgb = np.stack([luma + 1.403 * v, luma - 0.344 * u - 0.714 * v, luma + 1.773 * u], axis=-1)
        frames[i] = np.clip(np.rint(rgb * 255.0), 0, 255).astype(np.uint8)
    return frames


def render(clip: Clip, size: tuple[int, int]) -> np.ndarray:
    """The clip's frames at `size`, effects applied."""
    parts = [_render(shot.look, shot.frames, shot.offset, size) for shot in clip.shots]
    frames = np.concatenate(parts).astype(np.float32)
    starts = np.cumsum([0] + [shot.frames for shot in clip.shots])
    for effect in clip.effects:
        kind, first, count = effect[:3]
        if kind == "flash":
            gain = effect[3]
            frames[first : first + count] = frames[first : first + count] * (1 - gain) + 255.0 * gain
            continue
        # A fade or dissolve across the boundary at `first + count // 2`: the shots on both sides are rendered on
        # past it (their cameras carry on) and mixed.
        boundary = first + count // 2
        shot = int(np.searchsorted(starts, boundary, side="right")) - 1
        before, after = clip.shots[shot - 1], clip.shots[shot]
        span = np.arange(first, first + count)
        early = _render(before.look, count, before.offset + first - starts[shot - 1], size).astype(np.float32)
        late = _render(after.look, count, after.offset + first - starts[shot], size).astype(np.float32)
        weight = ((span - first + 1) / (count + 1))[:, None, None, None].astype(np.float32)
        if kind == "dissolve":
            frames[span] = early * (1 - weight) + late * weight
        else:  # through black: down to it over the first half, up from it over the second
            down = np.clip(1 - 2 * weight, 0, 1)
            up = np.clip(2 * weight - 1, 0, 1)
            frames[span] = early * down + late * up
    return np.clip(np.rint(frames), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------------------------- the clips

BASE = Look(texture="blobs", seed=1, tint=(0.12, -0.08), level=0.5)
TINTS = ((0.12, -0.08), (-0.2, 0.1), (0.15, 0.22), (-0.05, -0.25), (0.25, 0.05))
LEVELS = (0.3, 0.5, 0.72, 0.38, 0.62)  # between any two neighbours at least 0.12, and no shot returns to one before
TEXTURES = (("blobs", 1), ("fine", 2), ("stripes", 3), ("fine", 4), ("blobs", 5))
MOTIONS = (
    ((0.0, 0.0), (0.004, 0.012)),
    ((0.9, 0.4), (-0.01, 0.0)),
    ((0.3, 1.3), (0.006, -0.015)),
    ((1.6, 0.8), (0.0, 0.02)),
    ((0.5, 1.9), (-0.008, -0.006)),
)
# Shots that differ in colour and texture, as in the clip of the issue that asked for the set.
TEXTURES_AND_TINTS = (("blobs", 21, (0.12, -0.08)), ("stripes", 22, (-0.2, 0.1)), ("fine", 23, (0.15, 0.22)))
# Shots of 1, 8 and 60 frames between two longer ones: cuts 1, 8 and 60 frames apart.
LENGTHS = (20, 1, 8, 60, 14)


def _looks(category: str) -> list[Look]:
    looks = []
    for i in range(len(LENGTHS)):
        if category == "colour":
            looks.append(replace(BASE, tint=TINTS[i]))
        elif category == "luma":
            looks.append(replace(BASE, level=LEVELS[i]))
        elif category == "texture":
            looks.append(replace(BASE, texture=TEXTURES[i][0], seed=TEXTURES[i][1]))
        elif category == "motion":
            looks.append(replace(BASE, origin=MOTIONS[i][0], motion=MOTIONS[i][1]))
        else:
            looks.append(
                Look(
                    texture=TEXTURES[i][0],
                    seed=TEXTURES[i][1] + 10,
                    origin=MOTIONS[i][0],
                    motion=MOTIONS[i][1],
                    tint=TINTS[(i + 2) % 5],
                    level=LEVELS[(i + 1) % 5],
                    contrast=0.12 + 0.03 * i,
                )
            )
    return looks


def hard_cut_clip(category: str) -> Clip:
    """Five shots of 20, 1, 8, 60 and 14 frames: four hard cuts that change `category` only (or everything)."""
    looks = _looks(category)
    # Where only the colour or the luma changes, the camera carries on over the cut, as a grade or exposure change.
    carry = category in ("colour", "luma")
    shots, start = [], 0
    for look, length in zip(looks, LENGTHS, strict=True):
        shots.append(Shot(look=look, frames=length, offset=start if carry else 0))
        start += length
    cuts = tuple(int(c) for c in np.cumsum(LENGTHS)[:-1])
    return Clip(name=f"cut-{category}", category=f"cut:{category}", shots=tuple(shots), cuts=cuts)


def clips() -> list[Clip]:
    """Every clip of the set (each is written at both sizes)."""
    hard = [hard_cut_clip(category) for category in ("colour", "luma", "texture", "motion", "all")]
    a, b = _looks("all")[0], _looks("all")[3]
    pan = replace(BASE, texture="fine", seed=7, motion=(0.02, 0.2))
    whip = replace(BASE, texture="blobs", seed=8, motion=(0.05, -0.3))
    fine, twice = replace(BASE, texture="fine", seed=9), ("flash", 28, 1, 0.6)
    fade, dissolve, flash, pans = "gradual:fade", "gradual:dissolve", "no-cut:flash", "no-cut:pan"
    return [
        *hard,
        Clip(name="fade-black", category=fade, shots=(Shot(a, 24), Shot(b, 24)), effects=(("fade", 12, 24),)),
        Clip(name="dissolve-8", category=dissolve, shots=(Shot(a, 20), Shot(b, 20)), effects=(("dissolve", 16, 8),)),
        Clip(name="dissolve-20", category=dissolve, shots=(Shot(a, 24), Shot(b, 24)), effects=(("dissolve", 14, 20),)),
        Clip(name="flash-white", category=flash, shots=(Shot(BASE, 40),), effects=(("flash", 12, 2, 0.8), twice)),
        Clip(name="flash-3", category=flash, shots=(Shot(fine, 40),), effects=(("flash", 15, 3, 0.5),)),
        Clip(name="pan-fast", category=pans, shots=(Shot(pan, 40),)),
        Clip(name="pan-whip", category=pans, shots=(Shot(whip, 40),)),
    ]  # fmt: skip


@dataclass(frozen=True)
class Written:
    clip: Clip
    size: tuple[int, int]
    path: Path


def write_set(folder: Path) -> list[Written]:
    """Every clip at every size under `folder`, compressed (returns them in order)."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for clip in clips():
        for size in SIZES:
            path = folder / f"{clip.name}-{size[1]}x{size[0]}.mp4"
            if not path.exists():
                media.write_video(path, render(clip, size), FPS, None, encoding=ENCODING)
            written.append(Written(clip=clip, size=size, path=path))
    return written


def match(truth: tuple[int, ...], found: tuple[int, ...], tolerance: int = TOLERANCE) -> tuple[int, int, int]:
    """(hits, misses, false cuts): each true cut is matched to at most one found cut within `tolerance` frames,
    nearest first."""
    left = list(found)
    hits = 0
    for cut in truth:
        near = sorted((abs(f - cut), f) for f in left if abs(f - cut) <= tolerance)
        if near:
            left.remove(near[0][1])
            hits += 1
    return hits, len(truth) - hits, len(left)

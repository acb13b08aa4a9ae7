"""Video and audio files for the super-resolution pipeline, one job a module:

    selection   which source frames a clip keeps and the rate they play at (24-fps rule, 1 + 8k frames)
    probing     what a source file is, before any frame is decoded
    colour      a source's colour tags and HDR metadata, and the tags its output keeps (or why it is refused)
    timing      a variable frame rate found from the frames' timestamps, frames chosen on them
    clock       a variable-rate output's frame times, as its source has them (`--fps source`)
    fields      an interlaced source's field order found (stream flags, combing in the picture), its frames deinterlaced
    reading     a source's frames decoded as RGB
    audio       a file's audio as the contract's mono 44.1 kHz track
    writing     frames encoded as a reproducible file, segments joined, the audio added
    streams     the source's own audio and subtitle streams carried into the output (`--audio original`)
    checking    the health check before publish: the written output decoded once and compared with its plan

Real inputs come at any rate, length, size and pixel format, sometimes with lying or missing metadata; these modules
are the one place that turns such files into RGB arrays the model can take, and upscaled arrays (plus the audio)
back into a playable file. All are pure functions over PyAV (no torch), testable without orchestration or storage.

Callers use this package as one namespace (`media.probe`, `media.write_video`): their own names (`probe`, `audio`)
would shadow a function or module imported by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k6vsr_core.lazy import lazy_attributes

# Loaded on first use, as `media.probe` is reached: importing one module of the package (`media.encoding`, which the
# request's model needs) must not import PyAV and every other module with it (`k6vsr --help` answers at once).
if TYPE_CHECKING:
    from k6vsr_core.media.audio import AUDIO_SAMPLE_RATE, check_audio_file, decode_audio, trim_audio, write_audio_track
    from k6vsr_core.media.checking import BT709_TV, UNTAGGED, ColourTags, OutputMismatch, PlannedOutput, check_output
    from k6vsr_core.media.clock import MATROSKA_TICK, FrameRate, Timeline, span_s
    from k6vsr_core.media.colour import output_colour
    from k6vsr_core.media.fields import FieldInfo, FieldOrder, probe_fields
    from k6vsr_core.media.hdr import HdrMetadata
    from k6vsr_core.media.probing import MAX_SOURCE_PIXELS, MAX_SOURCE_SIDE, VideoProbe, probe
    from k6vsr_core.media.reading import eight_bits, iter_frames, read_frames, scan_frames
    from k6vsr_core.media.selection import (
        MAX_NUM_FRAMES,
        RESAMPLE_FPS_TOLERANCE,
        TARGET_FPS,
        aligned_frame_count,
        select_all_frames,
        select_frames,
    )
    from k6vsr_core.media.timing import FrameTiming, frame_times, frames_on_times, timeline_of, timing_of
    from k6vsr_core.media.writing import HEVC_MIN_SIDE, concat_segments, planned_output, write_segment, write_video

_HOMES = {
    "AUDIO_SAMPLE_RATE": "audio",
    "check_audio_file": "audio",
    "decode_audio": "audio",
    "trim_audio": "audio",
    "write_audio_track": "audio",
    "BT709_TV": "checking",
    "UNTAGGED": "checking",
    "ColourTags": "checking",
    "OutputMismatch": "checking",
    "PlannedOutput": "checking",
    "check_output": "checking",
    "MATROSKA_TICK": "clock",
    "FrameRate": "clock",
    "Timeline": "clock",
    "span_s": "clock",
    "HdrMetadata": "hdr",
    "output_colour": "colour",
    "FieldInfo": "fields",
    "FieldOrder": "fields",
    "probe_fields": "fields",
    "MAX_SOURCE_PIXELS": "probing",
    "MAX_SOURCE_SIDE": "probing",
    "VideoProbe": "probing",
    "probe": "probing",
    "eight_bits": "reading",
    "iter_frames": "reading",
    "read_frames": "reading",
    "scan_frames": "reading",
    "MAX_NUM_FRAMES": "selection",
    "RESAMPLE_FPS_TOLERANCE": "selection",
    "TARGET_FPS": "selection",
    "aligned_frame_count": "selection",
    "select_all_frames": "selection",
    "select_frames": "selection",
    "FrameTiming": "timing",
    "frame_times": "timing",
    "frames_on_times": "timing",
    "timeline_of": "timing",
    "timing_of": "timing",
    "HEVC_MIN_SIDE": "writing",
    "concat_segments": "writing",
    "planned_output": "writing",
    "write_segment": "writing",
    "write_video": "writing",
}

__all__ = [
    "AUDIO_SAMPLE_RATE",
    "BT709_TV",
    "UNTAGGED",
    "HdrMetadata",
    "output_colour",
    "HEVC_MIN_SIDE",
    "MATROSKA_TICK",
    "MAX_NUM_FRAMES",
    "MAX_SOURCE_PIXELS",
    "MAX_SOURCE_SIDE",
    "RESAMPLE_FPS_TOLERANCE",
    "TARGET_FPS",
    "ColourTags",
    "FieldInfo",
    "FieldOrder",
    "FrameRate",
    "FrameTiming",
    "Timeline",
    "OutputMismatch",
    "PlannedOutput",
    "VideoProbe",
    "aligned_frame_count",
    "eight_bits",
    "iter_frames",
    "check_audio_file",
    "check_output",
    "concat_segments",
    "decode_audio",
    "frame_times",
    "frames_on_times",
    "planned_output",
    "probe",
    "probe_fields",
    "read_frames",
    "scan_frames",
    "select_all_frames",
    "select_frames",
    "span_s",
    "timeline_of",
    "timing_of",
    "trim_audio",
    "write_audio_track",
    "write_segment",
    "write_video",
]


__getattr__ = lazy_attributes(__name__, _HOMES)

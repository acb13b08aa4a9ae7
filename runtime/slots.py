"""How many tasks of each kind one process runs at once (the lanes of `runtime.lanes`), and where.

Model tasks (encode, denoise, decode): two at once, which the memory budget (k6vsr_core.model.memory) allows for, so one
task's store reads and writes overlap the other's model work. Blends and segments: three more threads beside them,
since a blend holds its thread from its window's first decoded tile to its last: the blends of a window and of the
next one (or of the next clip's first window, in an archive) and the segment of the window before.

The clusters this project starts (warm workers, `--gpus`) keep the two kinds in processes of their own: a model
worker per device declares `MODEL_SLOTS` units of `MODEL_RESOURCE` and runs that many threads, so the process that
holds the model and drives the GPU only computes, and CPU-lane workers (no device, no model) declare
`CPU_THREADS` units of `CPU_RESOURCE`: a blend, a segment's x264 encode or the quality report never takes the
model process's GIL or cores. `--workers N` clusters are CPU processes that take both kinds.
"""

MODEL_RESOURCE = "k6vsr-model"
CPU_RESOURCE = "k6vsr-cpu"
MODEL_SLOTS = 2
CPU_THREADS = 3  # two windows' blends and the segment of the window before them
WORKER_THREADS = MODEL_SLOTS + CPU_THREADS
WORKER_RESOURCES = {MODEL_RESOURCE: MODEL_SLOTS}
# A model worker of a split cluster takes one task more than the device computes at once: while one computes and
# the next waits at the memory gate (k6vsr_core.device.gate) with its inputs read, a third reads its inputs from the
# store,
# so the device never waits for a read, a write or a scheduler's round trip.
MODEL_WORKER_SLOTS = MODEL_SLOTS + 1
MODEL_WORKER_RESOURCES = {MODEL_RESOURCE: MODEL_WORKER_SLOTS}
CPU_WORKER_RESOURCES = {CPU_RESOURCE: CPU_THREADS}

# An archive's clips in flight at once. Two keep the GPU busy across clips: while one clip blends, encodes its
# segments and muxes, the next one's frames are read and its tiles take the model lane (runtime.schedule.ModelQueue);
# a third would only bring its frames and latents into the store sooner.
ARCHIVE_CLIPS_IN_FLIGHT = 2

"""How many tasks of each kind one process runs at once (the lanes of `runtime.lanes`).

Model tasks (encode, denoise, decode): two at once, which the memory budget (k6vsr_core.memory) allows for, so one
task's store reads and writes overlap the other's model work. Blends and segments: three more threads beside them,
since a blend holds its thread from its window's first decoded tile to its last: the blends of a window and of the
next one (or of the next clip's first window, in an archive) and the segment of the window before. Dask workers
started here declare the model slots as a resource and run both kinds of thread.
"""

MODEL_RESOURCE = "k6vsr-model"
MODEL_SLOTS = 2
CPU_THREADS = 3  # two windows' blends and the segment of the window before them
WORKER_THREADS = MODEL_SLOTS + CPU_THREADS
WORKER_RESOURCES = {MODEL_RESOURCE: MODEL_SLOTS}

# An archive's clips in flight at once. Two keep the GPU busy across clips: while one clip blends, encodes its
# segments and muxes, the next one's frames are read and its tiles take the model lane (runtime.schedule.ModelQueue);
# a third would only bring its frames and latents into the store sooner.
ARCHIVE_CLIPS_IN_FLIGHT = 2

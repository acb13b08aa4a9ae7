"""How many tasks of each kind one process runs at once (the lanes of `flows.lanes`).

Model tasks (encode, denoise, decode): two at once, which the memory budget (k6vsr_core.memory) allows for, so one
task's store reads and writes overlap the other's model work. Blends and segments: two more threads beside them. Dask
workers started here declare the model slots as a resource and run both kinds of thread.
"""

MODEL_RESOURCE = "k6vsr-model"
MODEL_SLOTS = 2
CPU_THREADS = 2  # a window's blend and the segment of the window before it
WORKER_THREADS = MODEL_SLOTS + CPU_THREADS
WORKER_RESOURCES = {MODEL_RESOURCE: MODEL_SLOTS}

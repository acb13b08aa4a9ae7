"""The device and the process: compute profiles, determinism, the process environment, the compile cache, memory
modes and precision. Below `model`; needs nothing of `contract` or `media`."""

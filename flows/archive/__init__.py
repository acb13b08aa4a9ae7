"""The parts of the archive flow (`flows.upscale_archive`): its sources, plan, clip runs and manifest."""

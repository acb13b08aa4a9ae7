"""The model contract: the request, the plan of a clip (windows, tiles, segments, scenes), its source and latent
inputs, the quality report and the released configuration. Pure functions; above `media`."""

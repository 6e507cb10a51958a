"""The models the command line builds and serves, offline: the tiny models (``serve-tiny``,
``build-model``), a tiny model per wire format and a tiny gpt-oss (``serve-tiny --parser``), and the
real SmolLM2-135M (``--flavour real``, the demo); with the tool pool and the transcripts the tiny
models are trained on, and the variables that place their cache. The tests serve the same models."""

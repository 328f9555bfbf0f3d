"""The small GPT, its stdlib-text data and the elastic-training plan used by `make demo`, the examples, the
benchmarks and the GPU proof."""

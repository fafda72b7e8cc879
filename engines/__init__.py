"""Models and runtimes: pre/post-processing, backends, the worker pool."""

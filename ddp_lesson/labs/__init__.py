"""Small programs that the notebooks' torchrun cells (and the multi-process tests) launch.

Each lab module can run on its own under torchrun (its docstring starts with the command) and
exposes its steps as functions, so a notebook cell can call them and a test can check what
they print against torch's own implementation.
"""

"""The teaching core: each idea of the series in one short module that a notebook prints whole.

Every module here holds one algorithm in its plainest correct form (NaiveDDP, BucketedDDP, and
their siblings), imports only torch and other ``ddp_lesson.core`` modules, and stays within 300
lines including its docstrings, so a reader meets the algorithm itself and no machinery around
it. The hardened drop-ins that the trainer and the labs use (torch's constructor signature,
checks that name ranks and parameters, ``Join``, recorders) live in the package's other modules
as layers on top of these cores; tests compare each core with torch's own implementation.
"""

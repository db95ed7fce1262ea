"""The teaching core: each idea of the series in one short module that a notebook prints whole.

Every module here holds one algorithm in its plainest correct form (NaiveDDP, BucketedDDP, and
their siblings), imports only torch and other ``ddp_lesson.core`` modules, and stays within 300
lines including its docstrings, so a reader meets the algorithm itself and no machinery around
it. The labs, the notebooks, the exercises' references and the trainer's ``--ddp
naive|bucketed`` run these classes (a comm hook and a recorder are the labs' seam); torch's
signature, ``Join`` and the rest are torch's DDP's (``--ddp torch``). Tests compare each core
with torch's.
"""

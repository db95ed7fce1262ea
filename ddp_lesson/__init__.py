"""ddp-lesson: data-parallel training with PyTorch, taught from scratch and checked against torch.

Also an IPython extension: ``%load_ext ddp_lesson`` registers the ``%%torchrun`` cell magic and
the persistent-rank magics ``%dist_start``, ``%%ranks``, ``%dist_stop``, ``%dist_status``, and
``%ddp_doctor`` (the preflight of :mod:`ddp_lesson.doctor`).
Importing the package is cheap (torch is imported by the modules that need it).
"""
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """Register ``%%torchrun`` (:mod:`ddp_lesson.launch`) and the cluster magics
    (:mod:`ddp_lesson.cluster`)."""
    from .cluster import load_ipython_extension as _load_cluster
    from .doctor import doctor_magic
    from .launch import load_ipython_extension as _load

    _load(ipython)
    _load_cluster(ipython)
    ipython.register_magic_function(doctor_magic, "line", "ddp_doctor")

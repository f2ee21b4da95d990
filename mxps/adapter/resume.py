"""A Gluon job resumed from a disk store (MXPS_STORE_RESUME=1, docs/STORE.md)."""


def resume_trainer(trainer):
    """Set up ``trainer``'s kvstore now and pull every parameter's stored value into it.

    Gluon sets up its kvstore lazily, at the first ``trainer.step``: by then the first
    gradient has been computed on the freshly initialised weights, not on the resumed ones (an
    uninterrupted job does not notice: worker 0's initial weights are the servers'). A resumed
    job calls this once, after the parameters are initialised (shapes known) and before its
    first forward pass; the servers ignore the INIT values of a resumed store and answer the
    pulls with what they stored.  Module needs nothing: ``init_optimizer`` pulls at once.
    Returns the trainer."""
    if getattr(trainer, "_params_to_init", None) is None:
        raise TypeError("resume_trainer needs a gluon.Trainer, got %r" % (trainer,))
    deferred = [p.name for p in trainer._params if p._deferred_init]
    if deferred:
        raise ValueError("resume_trainer: parameters %s are not initialised yet (deferred "
                         "shapes); run one forward pass first or give their shapes"
                         % ", ".join(deferred))
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    return trainer


def resume_round(trainer):
    """The step a resumed job goes on from: the rounds behind the checkpoint every server
    returned to (the scheduler agrees it from what the stores hold: the newest common
    checkpoint after a crash, the last round after a clean stop); 0 for a new job.  Takes a
    gluon.Trainer (its kvstore set up: call ``resume_trainer`` first) or an mxps kvstore."""
    kv = getattr(trainer, "_kvstore", trainer)
    if not hasattr(kv, "resume_round"):
        raise TypeError("resume_round needs an mxps kvstore or a Trainer using one, got %r"
                        % (trainer,))
    return kv.resume_round

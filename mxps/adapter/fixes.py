"""In-process fixes of MXNet 1.9.1 that ``import mxps`` applies in a worker.

The same fix as patch file 0002 (``patches/``, applied to the installed files by the tool
``mxps-patch``), for what can be repaired in the running interpreter without touching files:
``mxnet.model._create_kvstore`` drops a registered Python kvstore plugin on one device.

And one without a patch file: Gluon's Trainer refuses any kvstore that is not the native
``KVStore`` class once a parameter has row-sparse gradients ("Cannot use ... for multi-device
training with sparse gradients", a guard meant for native local multi-device training), so a
Python plugin such as mxps could never train an ``Embedding(sparse_grad=True)``.  The name
``KVStore`` that check reads in ``mxnet.gluon.trainer`` becomes ``(KVStore, KVStoreBase)``:
registered plugins pass, anything else is refused as before.
"""
import importlib
import logging
import sys
import warnings

logger = logging.getLogger(__name__)

#: MXNet version the fixes were written and verified against.
MXNET_VERSION = "1.9.1"


def _plugin_aware_create_kvstore(original, kvs, update_on_kvstore_default):
    """A `_create_kvstore` that keeps registered Python plugins, else defers to `original`."""
    def _create_kvstore(kvstore, num_device, arg_params):
        if (isinstance(kvstore, str) and num_device == 1 and "dist" not in kvstore
                and kvstore.lower() in kvs.KVStoreBase.kv_registry):
            # mxps fix (patch 0002): the native code drops a single-device, non-"dist" name
            # (kv=None: un-synchronised training). A registered plugin may be distributed.
            update_on_kvstore = update_on_kvstore_default()
            kv = kvs.create(kvstore)
            update_on_kvstore &= kv.is_capable(kvs.KVStoreBase.OPTIMIZER)
            return (kv, update_on_kvstore)
        return original(kvstore, num_device, arg_params)
    _create_kvstore.__doc__ = original.__doc__
    _create_kvstore.__wrapped__ = original
    _create_kvstore._mxps_fixed = True
    return _create_kvstore


# Modules that bind `_create_kvstore` by name (``from ..model import _create_kvstore``).
# contrib.svrg_optimization.svrg_module calls ``mx.model._create_kvstore`` (attribute look-up)
# and is covered by rebinding mxnet.model.
_CREATE_KVSTORE_USERS = ("mxnet.gluon.trainer", "mxnet.module.module")


def apply_runtime_fixes(role, update_on_kvstore_default):
    """Apply the in-process fixes to the running interpreter's mxnet; safe to call repeatedly.

    Fix 0002: ``mxnet.model._create_kvstore`` (and the names bound to it in
    ``mxnet.gluon.trainer`` and ``mxnet.module.module``) is replaced by a version that keeps
    a registered Python KVStoreBase plugin. Also correct when patch 0002 is applied to the file.

    ``role`` is this process's DMLC_ROLE; ``update_on_kvstore_default()`` reads MXNet's
    MXNET_UPDATE_ON_KVSTORE when a kvstore is created (as MXNet does; mxps.config reads it).
    This module imports nothing from mxps, so tests can load it by path.

    Imports mxnet, unless this process is a ps-lite server/scheduler (``DMLC_ROLE``) that has
    not imported it yet: there ``import mxnet`` would start the native node, and no Trainer
    runs there anyway.

    Returns the list of module names whose binding was changed by this call ([] if nothing
    was left to do).
    """
    if role in ("server", "scheduler") and "mxnet" not in sys.modules:
        logger.debug("mxps: DMLC_ROLE=%s and mxnet not imported: runtime fixes skipped", role)
        return []
    import mxnet
    from mxnet import kvstore as kvs
    from mxnet import model

    version = getattr(mxnet, "__version__", "?")
    if version != MXNET_VERSION:
        warnings.warn("mxps runtime fixes were written for mxnet %s, found mxnet %s"
                      % (MXNET_VERSION, version), RuntimeWarning, stacklevel=2)
    changed = []
    current = model._create_kvstore
    if getattr(current, "_mxps_fixed", False):
        fixed = current
    else:
        fixed = _plugin_aware_create_kvstore(current, kvs, update_on_kvstore_default)
        model._create_kvstore = fixed
        changed.append("mxnet.model")
    for modname in _CREATE_KVSTORE_USERS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:             # pragma: no cover - part of every mxnet 1.9.1
            continue
        bound = getattr(mod, "_create_kvstore", None)
        if bound is None or getattr(bound, "_mxps_fixed", False):
            continue
        if bound is not fixed.__wrapped__ and bound is not current:
            # someone else rebound it: wrap theirs, so their change is kept as the fallback
            setattr(mod, "_create_kvstore", _plugin_aware_create_kvstore(bound, kvs,
                                                                  update_on_kvstore_default))
        else:
            setattr(mod, "_create_kvstore", fixed)
        changed.append(modname)
    try:
        trainer = importlib.import_module("mxnet.gluon.trainer")
    except ImportError:                 # pragma: no cover - part of every mxnet 1.9.1
        return changed
    if getattr(trainer, "KVStore", None) is kvs.KVStore:
        # the only use of the name in trainer.py is the sparse-gradient isinstance check
        trainer.KVStore = (kvs.KVStore, kvs.KVStoreBase)
        changed.append("mxnet.gluon.trainer.KVStore")
    return changed

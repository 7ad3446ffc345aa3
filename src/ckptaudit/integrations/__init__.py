"""Guards inside other libraries' training loops: each new checkpoint is audited as it is saved.

One file per library, each a thin adapter over :class:`ckptaudit.integrations.guard.Guard` (which calls
:func:`ckptaudit.audit`; nothing is re-implemented):

- :mod:`.transformers`: ``AuditCallback``, a ``TrainerCallback``;
- :mod:`.lightning`: ``AuditCallback``, a Lightning ``Callback``;
- :mod:`.accelerate`: ``guard_accelerator(accelerator, guard)``, a wrapper of ``Accelerator.save_state``;
- :mod:`.deepspeed`: ``save_checkpoint(engine, ...)``, which moves DeepSpeed's ``latest`` only when the new tag passes;
- :mod:`.torchtitan`: ``guard_checkpoint_manager(manager)``, a hook around ``CheckpointManager.save``;
- ckptaudit's own writer: ``ckptaudit.store.save_checkpoint(..., guard=...)``.

Importing this package imports none of those libraries; see ``docs/integrations/``.
"""

from __future__ import annotations

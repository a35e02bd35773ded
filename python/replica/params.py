"""AutoTrain-style parameter classes, one per task, built from the task registry.

``LLMTrainingParams`` has AutoTrain's field names and replica's defaults (which follow
AutoTrain's): every flag ``replica llm --train`` takes, i.e. the run's own flags (``model``,
``project_name``, ``data_path``, ...), every ``params:`` key of task llm-sft, the params twins
``chat_template`` and ``text_column``, and AutoTrain's fields that replica accepts only at
their default (``push_to_hub=False``, ...). ``ImageClassificationParams`` and
``TwoTowerParams`` are the same for ``replica --config`` of those tasks.

They are pydantic models, as AutoTrain's are: ``model_dump()``, ``model_dump_json()``,
``model_fields``, ``model_json_schema()``, ``model_validate()``; types are checked and coerced
(``lr="3e-5"`` is 3e-05) and a wrong type raises pydantic's ``ValidationError`` naming the
field. The field table is ``_fields.py``, generated from ``replica keys TASK --json``, and the
classes (``_models.py``) from it (python/tools/gen_fields.py); a test fails when a key exists on
one side only. The values themselves are checked by replica, whose message a refused value
raises as ``ConfigError``. ``None`` leaves a field at replica's default, except where null
means something (``valid_split=None``: no evaluation).
"""

from __future__ import annotations

from ._base import FieldSpec, Params
from ._models import ImageClassificationParams, LLMTrainingParams, TwoTowerParams

Field = FieldSpec  # the name of earlier versions

PARAMS_CLASSES = {cls.task: cls for cls in (LLMTrainingParams, ImageClassificationParams, TwoTowerParams)}

__all__ = ["FieldSpec", "ImageClassificationParams", "LLMTrainingParams", "PARAMS_CLASSES", "Params",
           "TwoTowerParams"]

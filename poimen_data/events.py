"""Event classes, value types, the Arrow event schema and validation (docs/DESIGN.md,
"Domain").

The public path of ``poimen_data.model`` (classes in ``model/_events.py``, the Arrow side in
``model/_arrow.py``), plus the ``ValidationError`` they raise.
"""

from __future__ import annotations

from poimen_data.errors import ValidationError
from poimen_data.model import *  # noqa: F403 - this module is the model's public path
from poimen_data.model import __all__ as _model_names

__all__ = [*_model_names, "ValidationError"]

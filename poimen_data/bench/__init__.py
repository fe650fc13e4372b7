"""``poimen bench``: every speed goal measured next to a reference timed in the same run
(``_runner``), the shared pieces (``_core``) and the scenarios (``_scenarios``).

Imports every layer below the face; nothing in the library imports it.
"""

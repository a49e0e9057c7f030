"""Tools beside running a model: the break-even planner (`plan.py`, `moepack plan`) and the measurements it stands
on (`bench.py`, `moepack bench`). The runtime reads only the measurements' cache, through runtime/tuning.py; it
imports nothing from here."""

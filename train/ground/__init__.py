"""The ground every part of train/ stands on: the errors a command reports in one line (errors.py), the one line about
a disk that refused a write (disk.py) and the run folder's layout (layout.py). Imports nothing of train/."""

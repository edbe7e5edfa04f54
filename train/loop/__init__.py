"""The training loop: the Trainer (trainer.py), one step (step.py), the fault policy (faults.py) and the end of
a run (epilogue.py), over the parts train/run/ built."""

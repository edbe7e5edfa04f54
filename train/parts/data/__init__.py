"""The prompt data of a run: the prompt files read and checked, and the sampler that draws each step's
prompts (prompts.py)."""

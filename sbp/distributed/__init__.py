"""Process launching for `sbp` programs.

`python -m sbp.distributed.launch` starts one worker per rank (built on torchrun); it lives
in a submodule so that `import sbp.distributed` stays cheap and imports nothing heavy.
"""

"""How steps run: the step runners, the step context, the quorum batch of a workflow's commands."""

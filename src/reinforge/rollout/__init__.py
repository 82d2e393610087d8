"""Rollouts: from tasks to scored trajectories, for training and evaluation alike.

Every task is an environment (`reinforge.envs`): a single-turn dataset task is an env with one
assistant turn, a tool or game task an env with many. This package owns the one path they all
take: the sampling settings (`sampling`), the episode loop that asks the engine for each turn
and the env for each reply, token-in/token-out (`episodes`), episodes as trainer trajectories
with their metrics (`trajectories`), and where a step's groups come from: this process's engine
or, in the disaggregated mode, the generator rank (`sources`).

It may import the engine, envs, tasks, rewards, data, types and the distributed helpers; it never
imports `reinforge.train` or the evaluation modules, which both import it (a test checks this).
"""

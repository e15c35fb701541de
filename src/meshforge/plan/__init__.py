"""The planner: a pure core of maths (plan/core) and its adapters from a job, the
command line and a measured machine (plan/jobs). No torch import anywhere here."""

"""The planner's adapters: a job config, the command line or a measured machine
mapped onto the pure core (plan/core).

job          a job config's prediction (`predict_for_job`: report.json's `predicted`)
auto         `parallel: auto`: the layout chosen at launch, and the machine it assumes
machine_fit  a measured machine (train's calibration) fitted into a profile, and cached
request      command-line inputs to model, cluster and plan (shared by plan and cost)
"""

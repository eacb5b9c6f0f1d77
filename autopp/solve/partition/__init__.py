"""The split of one configuration: exact dynamic programs, the simulator's refinement, brute force, naive baselines."""

"""The services: rollout, learner, reward, and what they share in `common`."""

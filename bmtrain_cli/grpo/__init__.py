"""Group relative policy optimisation (train_config.stage: grpo; docs/grpo.md): rewards, rollouts and
the clipped policy loss of TRL's GRPOTrainer."""

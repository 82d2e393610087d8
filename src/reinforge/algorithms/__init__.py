"""Advantages, policy losses and KL estimators: pure tensor functions, chosen by name."""

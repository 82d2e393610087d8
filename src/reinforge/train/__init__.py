"""Trainers: the RL loop, SFT, optimizer and the pieces they share."""
